{{/* Names. KubeRay appends "-<5 chars>" for each Ray cluster and "-head-svc" and the like
for its Services, which must stay within 63 characters: the release's names stop at 40. */}}
{{- define "structserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "structserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "structserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "structserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "structserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "structserve.labels" -}}
helm.sh/chart: {{ include "structserve.chart" . }}
{{ include "structserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "structserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "structserve.serveServiceName" -}}
{{- printf "%s-serve" (include "structserve.fullname" .) -}}
{{- end -}}

{{- define "structserve.redisName" -}}
{{- printf "%s-redis" (include "structserve.fullname" .) -}}
{{- end -}}

{{- define "structserve.redisSecretName" -}}
{{- default (include "structserve.redisName" .) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "structserve.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "structserve.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{- define "structserve.internalSecretName" -}}
{{- default (printf "%s-internal" (include "structserve.fullname" .)) .Values.internalSecrets.existingSecret -}}
{{- end -}}

{{- define "structserve.defaultKeySecretName" -}}
{{- printf "%s-default-api-key" (include "structserve.fullname" .) -}}
{{- end -}}

{{- define "structserve.configMapName" -}}
{{- printf "%s-config" (include "structserve.fullname" .) -}}
{{- end -}}

{{/* The mounted API keys file the service reads (args.api_keys_file). */}}
{{- define "structserve.apiKeysFile" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.apiKeys.mountPath) .Values.apiKeys.existingSecretKey -}}
{{- end -}}

{{/* A value kept across upgrades: the Secret's current one if it exists in the cluster (lookup
is empty under `helm template`), else `fallback`, else random. Returns base64. */}}
{{- define "structserve.stableSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .name -}}
{{- if and $existing (hasKey ($existing.data | default dict) .key) -}}
{{- index $existing.data .key -}}
{{- else if .fallback -}}
{{- .fallback | b64enc -}}
{{- else -}}
{{- randAlphaNum 40 | b64enc -}}
{{- end -}}
{{- end -}}

{{/* The args of the Serve application: serviceConfig plus what the chart owns. redis_url stays
null so the service reads REDIS_URL, which the pods get from a Secret. The ingress answers through
Ray's proxy (listener "proxy"): KubeRay's serve Service targets the proxy on every node. */}}
{{- define "structserve.serviceArgs" -}}
{{- $args := deepCopy .Values.serviceConfig -}}
{{- $_ := set $args "redis_url" nil -}}
{{- $_ := set $args "api_keys_file" (include "structserve.apiKeysFile" .) -}}
{{- $ingress := get $args "ingress" | default dict -}}
{{- $_ := set $ingress "port" (int .Values.serve.port) -}}
{{- $_ := set $ingress "host" "0.0.0.0" -}}
{{- $_ := set $ingress "listener" "proxy" -}}
{{- $_ := set $args "ingress" $ingress -}}
{{- include "structserve.storeArgs" (list $args .Values.adapterStore "adapters" "adapterStore") -}}
{{- include "structserve.storeArgs" (list $args .Values.fileStore "files" "fileStore") -}}
{{- toJson $args -}}
{{- end -}}

{{/* A store's PVC mount path or bucket URL into the service args' section (adapters, files):
(list $args $storeValues "section" "valuesName"). */}}
{{- define "structserve.storeArgs" -}}
{{- $args := index . 0 -}}
{{- $store := index . 1 | default dict -}}
{{- $key := index . 2 -}}
{{- $name := index . 3 -}}
{{- $pvc := $store.pvc | default dict -}}
{{- $bucket := $store.bucket | default dict -}}
{{- if and $pvc.claimName $bucket.url -}}
{{- fail (printf "%s: a PVC or a bucket, not both" $name) -}}
{{- end -}}
{{- if or $pvc.claimName $bucket.url -}}
{{- $section := get $args $key | default dict -}}
{{- if $section.store -}}
{{- fail (printf "%s: set there or in serviceConfig.%s.store, not both" $name $key) -}}
{{- end -}}
{{- if $pvc.claimName -}}
{{- $_ := set $section "store" $pvc.mountPath -}}
{{- else -}}
{{- $_ := set $section "store" $bucket.url -}}
{{- if $bucket.endpointUrl -}}
{{- $options := get $section "store_options" | default dict -}}
{{- $_ := set $options "endpoint_url" $bucket.endpointUrl -}}
{{- $_ := set $section "store_options" $options -}}
{{- end -}}
{{- end -}}
{{- $_ := set $args $key $section -}}
{{- end -}}
{{- end -}}

{{/* The bucket credentials' Secret both stores use (s3fs reads one pair from the environment). */}}
{{- define "structserve.bucketSecret" -}}
{{- $a := ((.Values.adapterStore | default dict).bucket | default dict).secretName -}}
{{- $f := ((.Values.fileStore | default dict).bucket | default dict).secretName -}}
{{- if and $a $f (ne $a $f) -}}
{{- fail "adapterStore.bucket.secretName and fileStore.bucket.secretName: one Secret for both (s3fs reads one pair of credentials)" -}}
{{- end -}}
{{- $a | default $f -}}
{{- end -}}

{{/* Ray's Serve config file (RayService.spec.serveConfigV2). */}}
{{- define "structserve.serveConfig" -}}
proxy_location: {{ .Values.serve.proxyLocation }}
http_options:
  host: 0.0.0.0
  port: {{ .Values.serve.port }}
  request_timeout_s: {{ .Values.serve.requestTimeoutS }}
applications:
  - name: {{ .Values.serve.applicationName }}
    route_prefix: {{ .Values.serve.routePrefix }}
    import_path: deployments.app:build_app
    args: {{ include "structserve.serviceArgs" . }}
{{- end -}}

{{/* REDIS_URL for the Ray containers. Kubernetes expands $(VAR) from variables defined before
it, so the password comes first. The variable is not named REDIS_PASSWORD: KubeRay gives that name
a meaning of its own (GCS fault tolerance). */}}
{{- define "structserve.redisEnv" -}}
{{- if eq .Values.redis.mode "internal" }}
- name: STRUCTSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "structserve.redisSecretName" . }}
      key: {{ .Values.redis.auth.existingSecretKey }}
- name: REDIS_URL
  value: {{ printf "redis://:$(STRUCTSERVE_REDIS_PASSWORD)@%s:6379/0" (include "structserve.redisName" .) | quote }}
{{- else if .Values.redis.external.existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else }}
- name: REDIS_URL
  value: {{ .Values.redis.external.url | quote }}
{{- end }}
{{- end -}}

{{/* The Ray container's environment, volume mounts and the pod's volumes: shared by the head
and every worker group. */}}
{{- define "structserve.rayEnv" -}}
# triton, torch and transformers cache under $HOME; the root filesystem is read-only
- name: HOME
  value: /tmp
{{- if eq .Values.ray.authMode "disabled" }}
# Ray 2.60 asks for a token unless told otherwise
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- include "structserve.redisEnv" . }}
# signs compile verdicts in Redis; every replica must share it
- name: STRUCTSERVE_VERDICT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "structserve.internalSecretName" . }}
      key: verdict-secret
{{- if .Values.internalSecrets.requireMetricsToken }}
# /metrics answers only this bearer token
- name: STRUCTSERVE_METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "structserve.internalSecretName" . }}
      key: metrics-token
{{- end }}
{{- with include "structserve.bucketSecret" . }}
# the stores' bucket credentials, as s3fs reads them
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- with .Values.ray.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "structserve.rayVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
# Named as KubeRay names it, so the autoscaler sidecar it injects shares this volume.
- name: ray-logs
  mountPath: /tmp/ray
- name: api-keys
  mountPath: {{ .Values.apiKeys.mountPath }}
  readOnly: true
- name: service-config
  mountPath: /etc/structserve/config
  readOnly: true
{{- with ((.Values.adapterStore | default dict).pvc | default dict) }}
{{- if .claimName }}
- name: adapter-store
  mountPath: {{ .mountPath }}
  readOnly: true
{{- end }}
{{- end }}
{{- with ((.Values.fileStore | default dict).pvc | default dict) }}
{{- if .claimName }}
- name: file-store
  mountPath: {{ .mountPath }}
{{- end }}
{{- end }}
{{- with .Values.ray.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "structserve.rayVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 2Gi
- name: ray-logs
  emptyDir:
    sizeLimit: {{ .Values.ray.tmpSizeLimit }}
- name: api-keys
  secret:
    secretName: {{ include "structserve.apiKeysSecretName" . }}
    items:
      - key: {{ .Values.apiKeys.existingSecretKey }}
        path: {{ .Values.apiKeys.existingSecretKey }}
- name: service-config
  configMap:
    name: {{ include "structserve.configMapName" . }}
{{- with ((.Values.adapterStore | default dict).pvc | default dict) }}
{{- if .claimName }}
- name: adapter-store
  persistentVolumeClaim:
    claimName: {{ .claimName }}
    readOnly: true
{{- end }}
{{- end }}
{{- with ((.Values.fileStore | default dict).pvc | default dict) }}
{{- if .claimName }}
- name: file-store
  persistentVolumeClaim:
    claimName: {{ .claimName }}
{{- end }}
{{- end }}
{{- with .Values.ray.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level settings common to Ray pods. */}}
{{- define "structserve.rayPodCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.ray.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
volumes:
  {{- include "structserve.rayVolumes" . | nindent 2 }}
{{- end -}}

{{/* Checks that values.schema.json cannot express (relations between values). */}}
{{- define "structserve.validate" -}}
{{- $maxGpus := 0 -}}
{{- $names := dict -}}
{{- range .Values.ray.workerGroups -}}
{{- if hasKey $names .name -}}
{{- fail (printf "ray.workerGroups: the name %q is used twice" .name) -}}
{{- end -}}
{{- $_ := set $names .name true -}}
{{- if or (gt (int .minReplicas) (int .replicas)) (gt (int .replicas) (int .maxReplicas)) -}}
{{- fail (printf "ray.workerGroups[%s]: need minReplicas <= replicas <= maxReplicas, got %d, %d, %d" .name (int .minReplicas) (int .replicas) (int .maxReplicas)) -}}
{{- end -}}
{{- if gt (int .gpus) $maxGpus -}}{{- $maxGpus = int .gpus -}}{{- end -}}
{{- end -}}
{{- $llm := .Values.serviceConfig.llm | default dict -}}
{{- $need := get $llm "num_gpus" | default 0 | float64 -}}
{{- if gt $need (float64 $maxGpus) -}}
{{- fail (printf "serviceConfig.llm.num_gpus=%v but no worker group offers more than %d GPUs per pod" $need $maxGpus) -}}
{{- end -}}
{{- if eq .Values.redis.mode "external" -}}
{{- if not (or .Values.redis.external.url .Values.redis.external.existingSecret) -}}
{{- fail "redis.mode=external needs redis.external.url or redis.external.existingSecret" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.ray.gcsFaultTolerance.enabled (eq .Values.redis.mode "external") (not .Values.ray.gcsFaultTolerance.redisAddress) -}}
{{- fail "ray.gcsFaultTolerance with redis.mode=external needs ray.gcsFaultTolerance.redisAddress" -}}
{{- end -}}
{{- if and (eq .Values.serve.proxyLocation "HeadOnly") .Values.serve.excludeHeadPodFromServeSvc -}}
{{- fail "serve.proxyLocation=HeadOnly with serve.excludeHeadPodFromServeSvc=true leaves the Service no proxy to send to" -}}
{{- end -}}
{{- $tenants := .Values.apiKeys.tenants | default dict -}}
{{- if and (not .Values.apiKeys.existingSecret) .Values.apiKeys.generateDefaultKey (hasKey $tenants "default") -}}
{{- fail "apiKeys: tenant \"default\" is both listed in apiKeys.tenants and generated (generateDefaultKey)" -}}
{{- end -}}
{{- end -}}
