{{- define "outbox-sidecar.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "outbox-sidecar.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The full name and .suffix, within .max characters, for kinds whose names Kubernetes holds
shorter than 63 or turns into labels. Cut, the full name ends in a hash of itself, so that two
long release names sharing a prefix (two regions of one service in one namespace) do not give
the same name. */}}
{{- define "outbox-sidecar.fit" -}}
{{- $full := include "outbox-sidecar.fullname" .root -}}
{{- $name := printf "%s-%s" $full .suffix -}}
{{- if le (len $name) (int .max) -}}
{{- $name -}}
{{- else -}}
{{- $keep := sub (sub (int .max) (len .suffix)) 10 | int -}}
{{- /* a cut may end in a '-' or a '.' (Helm allows dotted release names): not before a '-' */ -}}
{{- printf "%s-%s-%s" (regexReplaceAll "[-.]+$" ($full | trunc $keep) "") (sha256sum $full | trunc 8) .suffix -}}
{{- end -}}
{{- end -}}

{{- /* A value from values.yaml as text. Helm reads a values file's numbers as floats, which
       `quote` and printf write as 3.3554432e+07 from a million on (refused as an integer, by
       the sidecar's settings and Kafka's alike); JSON writes them whole, and a map as JSON. */}}
{{- define "outbox-sidecar.text" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{- define "outbox-sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox-sidecar.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "outbox-sidecar.labels" -}}
{{ include "outbox-sidecar.selectorLabels" . }}
{{ include "outbox-sidecar.chartLabels" . }}
{{- end -}}

{{- define "outbox-sidecar.chartLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- /* The reconciliation's pods, not the relays' selector labels: the relays' Deployment,
PodDisruptionBudget and ServiceMonitor would count them. */ -}}
{{- define "outbox-sidecar.reconcileSelectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox-sidecar.name" . }}-reconcile
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "outbox-sidecar.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "outbox-sidecar.tag" (dict "tag" .Values.image.tag "root" . "name" "image.tag")) -}}
{{- end -}}

{{- /* An image tag as given: a string, or an integer from --set (printf "%s" rendered one as
"%!s(int64=2)"). One a values file gives as a number is refused: YAML read it as one, and its
text is lost (1.10 is 1.1, 0123 is 83), so the pods would pull another image. */ -}}
{{- define "outbox-sidecar.tag" -}}
{{- $tag := default .root.Chart.AppVersion .tag -}}
{{- if or (kindIs "int64" $tag) (kindIs "int" $tag) -}}
{{- toString $tag -}}
{{- else if kindIs "string" $tag -}}
{{- $tag -}}
{{- else -}}
{{- fail (printf "%s: give it as a string (quoted, e.g. \"1.10\"): YAML read %v as a number, and the image it names would be another" .name $tag) -}}
{{- end -}}
{{- end -}}

{{- define "outbox-sidecar.secretName" -}}
{{- required "existingSecret: the name of a Secret with the key outbox_database__dsn" .Values.existingSecret -}}
{{- end -}}

{{/* The sidecar container: the standalone Deployment uses it, and so can an application's
chart, to run one relay in each of its pods (add the volumes of outbox-sidecar.volumes too). */}}
{{- define "outbox-sidecar.container" -}}
- name: outbox-sidecar
  image: {{ include "outbox-sidecar.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["run"]
  env:
    - name: OUTBOX_CONFIG_FILE
      value: /etc/outbox/sidecar.toml
    - name: OUTBOX_SECRETS_DIR
      value: /run/secrets/outbox
    - name: OUTBOX_HTTP__PORT
      value: {{ .Values.httpPort | quote }}
    - name: OUTBOX_DATABASE__SCHEMA_NAME
      value: {{ .Values.migrations.schema | quote }}
    {{- include "outbox-sidecar.checkEnv" . }}
    {{- $given := dict -}}
    {{- range $name, $value := .Values.env }}{{ $_ := set $given (upper $name) true }}{{ end }}
    {{- $chosen := or (hasKey $given "OUTBOX_ON_PART_STOPPED") (regexMatch "(?m)^[ \t]*on_part_stopped[ \t]*=" .Values.config) }}
    {{- if and (eq .Values.mode "sidecar") (not $chosen) }}
    {{- /* A sidecar that exits (a schema not migrated yet, a setting the broker refuses) is
           a container not running: its application's pod unready, out of its Service. */}}
    - name: OUTBOX_ON_PART_STOPPED
      value: retry
    {{- end }}
    {{- range $name, $value := .Values.env }}
    - name: {{ $name }}
      value: {{ include "outbox-sidecar.text" $value | quote }}
    {{- end }}
  ports:
    {{- /* not "http": in an application's pod, port names are the pod's, and its own
           container's "http" is what a Service or a PodMonitor naming "http" would find */}}
    - {name: outbox-http, containerPort: {{ .Values.httpPort }}}
  livenessProbe:
    httpGet: {path: /healthz, port: outbox-http}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 6
  {{- if ne .Values.mode "sidecar" }}
  {{- /* In an application's pod, readiness would take the application out of its Service
         whenever the broker is down: the very outage the outbox lets it ride out. */}}
  readinessProbe:
    httpGet: {path: /readyz, port: outbox-http}
    periodSeconds: 5
    timeoutSeconds: 5  {{- /* above relay/http.py's READY_WITHIN_S: /readyz says what is late */}}
  {{- end }}
  resources: {{- toYaml .Values.resources | nindent 4 }}
  securityContext: {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: outbox-config, mountPath: /etc/outbox, readOnly: true}
    - {name: outbox-secrets, mountPath: /run/secrets/outbox, readOnly: true}
{{- end -}}

{{/* The sidecar container as a native sidecar (Kubernetes 1.29 and later), for an application's
`initContainers`: started before the application's containers, and stopped only after they have
exited. As a plain container it got SIGTERM with the application, and the rows the application
committed while it drained waited for another pod's relay (with one replica, for the next pod). */}}
{{- define "outbox-sidecar.initContainer" -}}
{{ include "outbox-sidecar.container" . }}
  restartPolicy: Always
{{- end -}}

{{/* Settings the chart renders from its own values: given again in `env` or `config` they
would win over them (the probes on one port, the sidecar on another; the hook migrating one
schema, the sidecar reading another). */}}
{{- define "outbox-sidecar.checkEnv" -}}
{{- $own := dict "OUTBOX_HTTP__PORT" "httpPort" "OUTBOX_DATABASE__SCHEMA_NAME" "migrations.schema" "OUTBOX_CONFIG_FILE" "config" "OUTBOX_SECRETS_DIR" "existingSecret" -}}
{{- range $name, $value := .Values.env -}}
{{- if hasKey $own (upper $name) -}}
{{- fail (printf "env.%s: the chart sets it from %s; set that instead" $name (get $own (upper $name))) -}}
{{- end -}}
{{- end -}}
{{- /* The probes and the Service reach the sidecar's HTTP server on httpPort, on every
address: turned off or bound to loopback, the liveness probe failed and the kubelet restarted
the sidecar for ever (in sidecar mode, the application's pod unready each time) */ -}}
{{- range $name, $value := .Values.env -}}
{{- $upper := upper $name -}}
{{- if or (eq $upper "OUTBOX_HTTP") (eq $upper "OUTBOX_HTTP__ENABLED") (and (eq $upper "OUTBOX_HTTP__HOST") (not (has (toString $value) (list "0.0.0.0" "::")))) -}}
{{- fail (printf "env.%s: the chart's probes reach the sidecar's HTTP server on httpPort at every address (0.0.0.0, or :: as OUTBOX_HTTP__HOST); it may be neither turned off nor bound elsewhere" $name) -}}
{{- end -}}
{{- end -}}
{{- if regexMatch `(?m)^[ \t]*(\[[ \t]*["']?http["']?[ \t]*\]|["']?http["']?[ \t]*(\.|=[ \t]*\{))` .Values.config -}}
{{- fail "config: the http section is the chart's (httpPort; the probes reach the server at every address); leave it out (OUTBOX_HTTP__HOST=:: in env for IPv6)" -}}
{{- end -}}
{{- if regexMatch "(?m)^\\s*schema_name\\s*=" .Values.config -}}
{{- fail "config: database.schema_name is set from migrations.schema (the hook and the sidecar use it both); set that instead" -}}
{{- end -}}
{{- /* Secrets in the ConfigMap or the pod's spec are shown to whoever may read those: the
keys of settings that hold one, bare, dotted or quoted, at a line's start or in an inline table
(not a word of a value, as in a URL's "?dsn=") */ -}}
{{- $key := `(?:^|[{,])[ \t]*(?:[A-Za-z0-9_]+[ \t]*\.[ \t]*)*(dsn|sasl_password|ssl_key_password|secrets|["'](?:sasl\.password|sasl\.jaas\.config|sasl\.oauthbearer\.client\.secret|sasl\.oauthbearer\.config|ssl\.key\.password|ssl\.key\.pem|ssl\.keystore\.password)["'])[ \t]*=` -}}
{{- $found := regexFind (printf "(?m)%s" $key) .Values.config -}}
{{- if $found -}}
{{- fail (printf "config: %s holds a secret, and the ConfigMap shows it to anyone who may read ConfigMaps; put it in the Secret (existingSecret), one key per setting named like its variable in lower case (outbox_database__dsn, outbox_kafka__sasl_password, ...)" (regexReplaceAll (printf "^%s$" $key) (trim $found) "${1}")) -}}
{{- end -}}
{{- range $name, $value := .Values.env -}}
{{- $text := include "outbox-sidecar.text" $value -}}
{{- $secret := regexMatch `(?i)(__DSN|PASSWORD|__SECRETS)$` $name -}}
{{- if and (eq (upper $name) "OUTBOX_KAFKA__EXTRA") (regexMatch `(?i)password|passphrase|secret|jaas|oauthbearer\.config|key\.pem` $text) -}}
{{- $secret = true -}}
{{- end -}}
{{- /* a section given whole, as JSON (OUTBOX_DATABASE={"dsn": ...}): the keys of its secrets */ -}}
{{- if regexMatch `(?i)"(dsn|sasl_password|ssl_key_password|secrets|[^"]*(password|passphrase|jaas\.config|oauthbearer\.config|client\.secret|key\.pem))"\s*:` $text -}}
{{- $secret = true -}}
{{- end -}}
{{- if $secret -}}
{{- fail (printf "env.%s holds a secret, and the pod's spec shows it to anyone who may read it; put it in the Secret (existingSecret) as the key %s" $name (lower $name)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Deployment's terminationGracePeriodSeconds at least 2 s above relay.shutdown_grace
(`env` wins over `config`; 25 s by default): Kubernetes killed the relay in its stop, before it
handed its shards back, and they waited out relay.lease_duration. Found as a key of `config`
(in [relay], dotted or in an inline table), OUTBOX_RELAY__SHUTDOWN_GRACE or the relay section
given whole in OUTBOX_RELAY; read as seconds or ISO 8601 days, hours, minutes and seconds. A
form the chart cannot read is refused: forms it let pass unchecked (P1D, 00:01:00) outlasted
the pod's 30 s. */}}
{{- define "outbox-sidecar.checkGrace" -}}
{{- $given := regexFind `(?m)^[^#\n]*\bshutdown_grace["']?[ \t]*=[ \t]*("[^"]*"|'[^']*'|[^ \t,}#\n]+)` .Values.config -}}
{{- $text := regexReplaceAll `^[^#\n]*\bshutdown_grace["']?[ \t]*=[ \t]*` $given "" -}}
{{- range $name, $value := .Values.env -}}
{{- if eq (upper $name) "OUTBOX_RELAY__SHUTDOWN_GRACE" }}{{ $text = toString $value }}{{ end -}}
{{- if eq (upper $name) "OUTBOX_RELAY" -}}
{{- $json := include "outbox-sidecar.text" $value -}}
{{- $found := regexFind `"shutdown_grace"\s*:\s*("[^"]*"|[^,}\s]+)` $json -}}
{{- if $found }}{{ $text = regexReplaceAll `^"shutdown_grace"\s*:\s*` $found "" }}{{ end -}}
{{- end -}}
{{- end -}}
{{- $text = upper (trim (trimAll `"'` (trim $text))) -}}
{{- if not $text }}{{ $text = "25" }}{{ end -}}
{{- $seconds := -1.0 -}}
{{- $iso := `^P(?:([0-9]+)D)?(?:T(?:([0-9]+)H)?(?:([0-9]+)M)?(?:([0-9]+(?:[.][0-9]+)?)S)?)?$` -}}
{{- if regexMatch `^[0-9]+([.][0-9]+)?$` $text -}}
{{- $seconds = float64 $text -}}
{{- else if and (regexMatch $iso $text) (not (has $text (list "P" "PT"))) -}}
{{- $d := float64 (default "0" (regexReplaceAll $iso $text "${1}")) -}}
{{- $h := float64 (default "0" (regexReplaceAll $iso $text "${2}")) -}}
{{- $m := float64 (default "0" (regexReplaceAll $iso $text "${3}")) -}}
{{- $s := float64 (default "0" (regexReplaceAll $iso $text "${4}")) -}}
{{- $seconds = addf (mulf $d 86400) (mulf $h 3600) (mulf $m 60) $s -}}
{{- else -}}
{{- fail (printf "relay.shutdown_grace %q: give it as seconds or as ISO 8601 days, hours, minutes and seconds (e.g. PT25S, PT1M30S), so that the chart can hold terminationGracePeriodSeconds above it" $text) -}}
{{- end -}}
{{- $period := .Values.terminationGracePeriodSeconds -}}
{{- if and (not (kindIs "invalid" $period)) (lt (float64 $period) (addf $seconds 2)) -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be at least 2 s above relay.shutdown_grace (%s, %v s): Kubernetes kills the sidecar when it ends, before the relay's stop has handed its shards back and the process has exited" $period $text $seconds) -}}
{{- end -}}
{{- end -}}

{{/* Pod annotations for an application's chart that runs the sidecar: a changed `config`
rolls its pods, as it rolls the standalone Deployment's (the sidecar reads its file once). */}}
{{- define "outbox-sidecar.podAnnotations" -}}
checksum/outbox-config: {{ .Values.config | sha256sum }}
{{- end -}}

{{- define "outbox-sidecar.volumes" -}}
- name: outbox-config
  configMap: {name: {{ include "outbox-sidecar.fullname" . }}}
- name: outbox-secrets
  secret: {secretName: {{ include "outbox-sidecar.secretName" . }}}
{{- end -}}


{{/* The reconciliation's arguments are its container's command line, shown to whoever may
read the pod's spec (and to the node's process list): secrets go in reconcile.existingSecret
(the DSN) or reconcile.kafkaConfigSecret (the Kafka client's). */}}
{{- define "outbox-sidecar.checkReconcileArgs" -}}
{{- $secret := `(?i:password|secret|jaas|oauthbearer\.config|ssl\.key\.pem|ssl\.keystore\.key)` -}}
{{- range $key, $value := .kafkaOptions -}}
{{- if regexMatch $secret $key -}}
{{- fail (printf "reconcile.kafkaOptions.%s holds a secret, and the pod's spec shows it on the job's command line; put it in the properties file of reconcile.kafkaConfigSecret" $key) -}}
{{- end -}}
{{- end -}}
{{- range .extraArgs -}}
{{- if regexMatch `^--dsn?(=|$)` (toString .) -}}
{{- fail "reconcile.extraArgs: --dsn would show the DSN on the job's command line; the chart gives the job the DSN of reconcile.existingSecret" -}}
{{- else if regexMatch (printf "(%s)[^=]*=" $secret) (toString .) -}}
{{- fail (printf "reconcile.extraArgs: %q holds a secret, and the pod's spec shows it on the job's command line; put Kafka's in the properties file of reconcile.kafkaConfigSecret, the database's in reconcile.existingSecret" (regexReplaceAll (printf "^(.*?(?:%s)[^=]*=).*$" $secret) (toString .) "${1}...")) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The seconds of one of the reconciliation's durations, read as the job reads them ("90",
"1.5", "500ms", "30s", "5m", "1h", "2d", or a sum such as "1m30s"; a number of a values file
as it is: Go prints 1e6 and more in exponent form): called with (dict "name" <its value's
name> "value" <it>); fails naming a value the job would refuse. */}}
{{- define "outbox-sidecar.reconcileSeconds" -}}
{{- $seconds := 0.0 -}}
{{- if or (kindIs "float64" .value) (kindIs "int64" .value) (kindIs "int" .value) -}}
{{- $seconds = float64 .value -}}
{{- else -}}
{{- $text := lower (replace " " "" (trim (toString .value))) -}}
{{- if regexMatch `^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)(e[+-]?[0-9]+)?$` $text -}}
{{- $seconds = float64 $text -}}
{{- else -}}
{{- $parts := regexFindAll `[0-9]+(?:[.][0-9]+)?(?:ms|s|m|h|d)` $text -1 -}}
{{- if or (not $parts) (ne (join "" $parts) $text) -}}
{{- fail (printf "reconcile.%s: %q is not a duration (e.g. 90, 500ms, 30s, 5m, 1h, 1m30s)" .name (toString .value)) -}}
{{- end -}}
{{- $units := dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 "d" 86400.0 -}}
{{- range $parts -}}
{{- $unit := regexReplaceAll `^[0-9.]+` . "" -}}
{{- $seconds = addf $seconds (mulf (float64 (trimSuffix $unit .)) (get $units $unit)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if or (le $seconds 0.0) (gt $seconds (mulf 36500 86400.0)) -}}
{{- fail (printf "reconcile.%s: %v must be positive and at most 36500 days" .name .value) -}}
{{- end -}}
{{- $seconds -}}
{{- end -}}

{{/* What the job refuses of its durations at start is refused here, at the install or upgrade:
the job crash-looped (or its CronJob failed each run) on a release Helm had called deployed.
The relations are the job's (spark/config.py). A duration reconcile.extraArgs gives (by an
abbreviation argparse takes, too) leaves the relations it is in to the job. */}}
{{- define "outbox-sidecar.checkReconcileDurations" -}}
{{- $r := . -}}
{{- $continuous := eq $r.mode "continuous" -}}
{{- $seconds := dict -}}
{{- /* a scheduled run is not passed the trigger: the job's default (10s) counts */}}
{{- $_ := set $seconds "trigger" 10.0 -}}
{{- range $name := ternary (list "deadline" "horizon" "trigger") (list "deadline" "horizon") $continuous -}}
{{- $_ := set $seconds $name (float64 (include "outbox-sidecar.reconcileSeconds" (dict "name" $name "value" (get $r $name)))) -}}
{{- end -}}
{{- if and $continuous (lt (get $seconds "trigger") 0.1) -}}
{{- fail (printf "reconcile.trigger (%v) must be at least 100ms" $r.trigger) -}}
{{- end -}}
{{- $undelivered := $r.undeliveredDeadline -}}
{{- if and (not (kindIs "invalid" $undelivered)) (ne (toString $undelivered) "") -}}
{{- $_ := set $seconds "undeliveredDeadline" (float64 (include "outbox-sidecar.reconcileSeconds" (dict "name" "undeliveredDeadline" "value" $undelivered))) -}}
{{- end -}}
{{- $given := dict -}}
{{- range $r.extraArgs -}}
{{- $flag := regexReplaceAll `=.*$` (toString .) "" -}}
{{- if gt (len $flag) 2 -}}
{{- range $option := list "deadline" "undelivered-deadline" "horizon" "trigger" "summary-window" "findings-retention" -}}
{{- if hasPrefix $flag (printf "--%s" $option) }}{{ $_ := set $given $option true }}{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $deadline := get $seconds "deadline" -}}
{{- $horizon := get $seconds "horizon" -}}
{{- $trigger := get $seconds "trigger" -}}
{{- $triggers := ternary (toString $r.trigger) "the job's 10s: schedule mode passes none" $continuous -}}
{{- if and (hasKey $seconds "undeliveredDeadline") (lt (get $seconds "undeliveredDeadline") $deadline) (not (hasKey $given "deadline")) (not (hasKey $given "undelivered-deadline")) -}}
{{- fail (printf "reconcile.undeliveredDeadline (%v) must not be shorter than reconcile.deadline (%v)" $undelivered $r.deadline) -}}
{{- end -}}
{{- if and (lt $horizon (addf (mulf 2 $deadline) (mulf 2 $trigger))) (not (hasKey $given "horizon")) (not (hasKey $given "deadline")) (not (hasKey $given "trigger")) -}}
{{- fail (printf "reconcile.horizon (%v) must cover two reconcile.deadlines (%v) and two triggers (%s): raise it" $r.horizon $r.deadline $triggers) -}}
{{- end -}}
{{- if and (gt 60.0 (subf $horizon (mulf 2 $deadline))) (not (hasKey $given "horizon")) (not (hasKey $given "deadline")) (not (hasKey $given "summary-window")) -}}
{{- fail (printf "reconcile.horizon (%v) less two reconcile.deadlines (%v) must hold the job's summary window (1m): raise it" $r.horizon $r.deadline) -}}
{{- end -}}
{{- if and (ge $horizon (mulf 30 86400.0)) (not (hasKey $given "horizon")) (not (hasKey $given "findings-retention")) -}}
{{- fail (printf "reconcile.horizon (%v) must be shorter than the job's findings retention (30d), or pass a longer --findings-retention in reconcile.extraArgs" $r.horizon) -}}
{{- end -}}
{{- end -}}

{{/* reconcile.driverMemory as the JVM takes a heap (-Xmx: a number and a unit, k, m, g or t),
and at most 3/4 of the pod's memory limit: a number from a values file rendered as
"%!s(int64=1024)", which spark-submit refused, and a heap near the limit grew into the kernel's
OOM kill hours later (the JVM's memory outside its heap, and the Python driver's, come on top). */}}
{{- define "outbox-sidecar.checkDriverMemory" -}}
{{- $size := `^([0-9]+)([kKmMgGtT])$` -}}
{{- if not (and (kindIs "string" .driverMemory) (regexMatch $size (toString .driverMemory))) -}}
{{- fail (printf "reconcile.driverMemory: give it as a number and a unit, k, m, g or t, quoted (e.g. \"1g\", \"1536m\"), not %v" .driverMemory) -}}
{{- end -}}
{{- $units := dict "K" 1024.0 "M" 1048576.0 "G" 1073741824.0 "T" 1099511627776.0 -}}
{{- $heap := mulf (float64 (regexReplaceAll $size .driverMemory "${1}")) (get $units (upper (regexReplaceAll $size .driverMemory "${2}"))) -}}
{{- $limit := dig "limits" "memory" nil (.resources | default dict) -}}
{{- if not (kindIs "invalid" $limit) -}}
{{- $bytes := -1.0 -}}
{{- $quantity := `^([0-9]+(?:[.][0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$` -}}
{{- if or (kindIs "float64" $limit) (kindIs "int64" $limit) (kindIs "int" $limit) -}}
{{- $bytes = float64 $limit -}}
{{- else if regexMatch $quantity (toString $limit) -}}
{{- $kube := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 -}}
{{- $bytes = mulf (float64 (regexReplaceAll $quantity (toString $limit) "${1}")) (get $kube (regexReplaceAll $quantity (toString $limit) "${2}")) -}}
{{- else -}}
{{- fail (printf "reconcile.resources.limits.memory %q: give it as a quantity the chart can hold reconcile.driverMemory to (e.g. 3Gi, 2.5Gi, 3000M)" (toString $limit)) -}}
{{- end -}}
{{- if gt $heap (mulf $bytes 0.75) -}}
{{- fail (printf "reconcile.driverMemory (%s) must be at most 3/4 of reconcile.resources.limits.memory (%v): the JVM's memory outside its heap and the Python driver's come on top, and the kernel kills the pod at the limit" .driverMemory $limit) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The reconciliation's pod (reconcile.yaml), for its Deployment or its CronJob: called with
(dict "root" . "claim" <the checkpoint's claim>). */}}
{{- define "outbox-sidecar.reconcilePod" -}}
{{- $r := .root.Values.reconcile -}}
{{- $root := .root -}}
{{- include "outbox-sidecar.checkReconcileArgs" $r -}}
{{- include "outbox-sidecar.checkReconcileDurations" $r -}}
{{- include "outbox-sidecar.checkDriverMemory" $r -}}
metadata:
  labels: {{- include "outbox-sidecar.reconcileSelectorLabels" $root | nindent 4 }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- range $name, $value := . }}
    {{ $name }}: {{ include "outbox-sidecar.text" $value | quote }}
    {{- end }}
  {{- end }}
spec:
  {{- if eq $r.mode "schedule" }}
  restartPolicy: Never
  {{- end }}
  # stop() lets a judgement finish and joins the idle ticker (up to 60 s)
  terminationGracePeriodSeconds: {{ $r.terminationGracePeriodSeconds }}
  enableServiceLinks: false
  automountServiceAccountToken: false  # Spark runs local[*]: no Kubernetes API
  securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets: {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: reconcile
      image: {{ printf "%s:%s" $r.image.repository (include "outbox-sidecar.tag" (dict "tag" $r.image.tag "root" $root "name" "reconcile.image.tag")) }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      # the DSN from the Secret, never on the command line (ps shows it)
      command: [outboxctl, reconcile]
      # Spark 4 makes artifacts/ under the working directory: `/` is read-only, and every
      # query failed to start ("Failed to create a temp directory (under artifacts)")
      workingDir: /tmp
      args:
        - --schema
        - {{ $root.Values.migrations.schema | quote }}
        {{- if or $r.bootstrapServers (not $r.kafkaConfigSecret.name) }}
        - --bootstrap
        - {{ required "reconcile.bootstrapServers: the Kafka bootstrap servers" $r.bootstrapServers | quote }}
        {{- end }}
        {{- with $r.kafkaConfigSecret.name }}
        - --kafka-config
        - {{ printf "/etc/outbox/kafka/%s" $r.kafkaConfigSecret.key | quote }}
        {{- end }}
        {{- if $r.topics }}
        - --topics
        - {{ $r.topics | quote }}
        {{- else }}
        - --topic-pattern
        - {{ $r.topicPattern | quote }}
        {{- end }}
        - --marker-topic
        - {{ $r.markerTopic | quote }}
        - --dead-letter-topic
        - {{ $r.deadLetterTopic | quote }}
        {{- range $key, $value := $r.kafkaOptions }}
        - --kafka-option
        - {{ printf "%s=%s" $key (include "outbox-sidecar.text" $value) | quote }}
        {{- end }}
        - --deadline
        - {{ $r.deadline | quote }}
        {{- /* not `with`: a 0 given went unsaid, dropped as unset (checkReconcileDurations
               refuses it); null is unset */}}
        {{- if and (not (kindIs "invalid" $r.undeliveredDeadline)) (ne (toString $r.undeliveredDeadline) "") }}
        - --undelivered-deadline
        - {{ $r.undeliveredDeadline | toString | quote }}
        {{- end }}
        - --horizon
        - {{ $r.horizon | quote }}
        - --master
        - {{ $r.master | quote }}
        - --checkpoint
        {{- /* one directory per source: the job refuses a checkpoint made for other topics
               (Spark read a topic new to it from its start, all its retention at once), and a
               fresh one starts one horizon back */}}
        {{- $subscribed := printf "pattern:%s" $r.topicPattern }}
        {{- if $r.topics }}{{ $subscribed = join "," (sortAlpha (compact (splitList "," (nospace $r.topics)))) }}{{ end }}
        - {{ printf "/var/lib/outbox/checkpoint/by-source/%s" (printf "%s|%s" $subscribed $r.markerTopic | sha256sum | trunc 12) | quote }}
        {{- if eq $r.mode "schedule" }}
        - --once
        {{- if $r.failOnFindings }}
        - --fail-on-findings
        {{- end }}
        {{- else }}
        - --trigger
        - {{ $r.trigger | quote }}
        - --http-port
        - {{ $r.httpPort | quote }}
        {{- end }}
        {{- range $r.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: OUTBOX_DATABASE_URL
          valueFrom:
            secretKeyRef:
              name: {{ required "reconcile.existingSecret: a Secret with the key dsn (the reconciler's role)" $r.existingSecret }}
              key: dsn
        - name: HOME  # Spark and Java write under it; the root filesystem is read-only
          value: /tmp
        - name: PYSPARK_SUBMIT_ARGS  # the driver's heap and the UI, set before its JVM starts
          value: {{ printf "--driver-memory %s%s pyspark-shell" $r.driverMemory (ternary "" " --conf spark.ui.enabled=false" (eq (toString $r.sparkUI) "true")) | quote }}
      {{- if eq $r.mode "continuous" }}
      ports:
        - {name: http, containerPort: {{ $r.httpPort }}}
      # Alive while the JVM answers and the query runs (a query that failed ends the process
      # anyway); not whether judgements keep up: a first micro-batch over a long backlog takes
      # minutes, and a restart would only start it again. OutboxReconcileStalled says that.
      livenessProbe:
        httpGet: {path: /healthz, port: http}
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: 6
      readinessProbe:  # the query runs
        httpGet: {path: /readyz, port: http}
        periodSeconds: 10
        timeoutSeconds: 5
      {{- end }}
      resources: {{- toYaml $r.resources | nindent 8 }}
      securityContext: {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - {name: checkpoint, mountPath: /var/lib/outbox/checkpoint}
        - {name: tmp, mountPath: /tmp}  # Spark's local directory (shuffles, spills)
        {{- if $r.kafkaConfigSecret.name }}
        - {name: kafka-config, mountPath: /etc/outbox/kafka, readOnly: true}
        {{- end }}
  volumes:
    - name: checkpoint
      persistentVolumeClaim: {claimName: {{ .claim }}}
    - name: tmp
      {{- if $r.scratchSizeLimit }}
      emptyDir: {sizeLimit: {{ $r.scratchSizeLimit | quote }}}
      {{- else }}
      emptyDir: {}
      {{- end }}
    {{- with $r.kafkaConfigSecret.name }}
    - name: kafka-config
      # every key: a truststore or keystore beside the properties file that names it
      secret: {secretName: {{ . | quote }}, defaultMode: 0440}
    {{- end }}
  {{- with $root.Values.nodeSelector }}
  nodeSelector: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.tolerations }}
  tolerations: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.affinity }}
  affinity: {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
