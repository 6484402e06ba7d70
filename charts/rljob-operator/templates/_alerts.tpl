{{/*
Where each configurable threshold appears in files/rljob-alerts.rules.yaml (the plain rules file stays
the single source, unit-tested with promtool). A site is replaced only when the value differs from
the file's own (`default`), so default values ship the file unchanged; a site that is no longer in the
file fails the render, so an edit of the file can never silently disconnect a threshold.
`format` receives the value (times `scale` when given).
*/}}
{{- define "rljob-operator.alertThresholdSites" -}}
RLJobTruncationRateHigh:
  - {value: truncationRate, default: 0.25, field: expr, old: "* 0 + 0.25", format: "* 0 + %v"}
RLJobTokenWasteHigh:
  - {value: tokenWasteShare, default: 0.30, field: expr, old: "> 0.30", format: "> %v"}
  - {value: tokenWasteShare, default: 0.30, field: description, old: "more than 30%", format: "more than %v%%", scale: 100}
RLJobEngineIdleHigh:
  - {value: engineIdleShare, default: 0.5, field: expr, old: "> 0.5", format: "> %v"}
  - {value: engineIdleShare, default: 0.5, field: description, old: "more than half of the wall time", format: "more than %v of the wall time"}
RLJobEntropyCollapse:
  - {value: entropyDropRatio, default: 0.5, field: expr, old: "rljob_policy_entropy < 0.5 *", format: "rljob_policy_entropy < %v *"}
  - {value: entropyDropRatio, default: 0.5, field: description, old: "below half of its 1h maximum", format: "below %v times its 1h maximum"}
  - {value: entropyFloor, default: 0.05, field: expr, old: "rljob_policy_entropy < 0.05", format: "rljob_policy_entropy < %v"}
  - {value: entropyFloor, default: 0.05, field: description, old: "or below 0.05", format: "or below %v"}
RLJobRewardCollapse:
  - {value: rewardDropRatio, default: 0.5, field: expr, old: "rljob_reward_mean < 0.5 *", format: "rljob_reward_mean < %v *"}
  - {value: rewardDropRatio, default: 0.5, field: description, old: "below half of its maximum", format: "below %v times its maximum"}
  - {value: rewardMinPeak, default: 0.1, field: expr, old: "max_over_time(rljob_reward_mean[1h]) > 0.1", format: "max_over_time(rljob_reward_mean[1h]) > %v"}
RLJobNoRecentStep:
  - {value: noStepSeconds, default: 1800, field: expr, old: "> 1800", format: "> %v"}
  - {value: noStepSeconds, default: 1800, field: description, old: "in 30 minutes", format: "in %v seconds"}
RLJobAutotuneDegraded:
  - {value: autotuneFailures, default: 2, field: expr, old: "[15m]) > 2", format: "[15m]) > %v"}
{{- end }}

{{/* The runbook URL base of files/rljob-alerts.rules.yaml, replaced by prometheusRule.runbookBaseUrl. */}}
{{- define "rljob-operator.runbookBase" -}}
https://github.com/rljob/rljob/blob/main/docs/runbooks
{{- end }}

{{/* One alert rule of the file with the chart's thresholds, `for`, severity, runbook URL base and extra labels applied. */}}
{{- define "rljob-operator.alertRule" -}}
{{- $root := index . 0 }}
{{- $rule := deepCopy (index . 1) }}
{{- $values := $root.Values.prometheusRule }}
{{- $sites := include "rljob-operator.alertThresholdSites" $root | fromYaml }}
{{- range $site := (get $sites $rule.alert | default list) }}
{{- $text := "" }}
{{- if eq $site.field "expr" }}
{{- $text = $rule.expr }}
{{- else }}
{{- $text = get $rule.annotations $site.field }}
{{- end }}
{{- if not (contains $site.old $text) }}
{{- fail (printf "files/rljob-alerts.rules.yaml: the %s of alert %s no longer contains %q, so prometheusRule.thresholds.%s cannot be applied; update the sites in templates/_alerts.tpl" $site.field $rule.alert $site.old $site.value) }}
{{- end }}
{{- $value := float64 (get $values.thresholds $site.value) }}
{{- if ne $value (float64 $site.default) }}
{{- $shown := $value }}
{{- if $site.scale }}
{{- $shown = round (mulf $value $site.scale) 4 }}
{{- end }}
{{- $text = replace $site.old (printf $site.format $shown) $text }}
{{- if eq $site.field "expr" }}
{{- $_ := set $rule "expr" $text }}
{{- else }}
{{- $_ := set $rule.annotations $site.field $text }}
{{- end }}
{{- end }}
{{- end }}
{{- $base := include "rljob-operator.runbookBase" $root }}
{{- if not (hasPrefix (printf "%s/" $base) $rule.annotations.runbook_url) }}
{{- fail (printf "files/rljob-alerts.rules.yaml: the runbook_url of alert %s does not start with %s/" $rule.alert $base) }}
{{- end }}
{{- $_ := set $rule.annotations "runbook_url" (printf "%s/%s" (trimSuffix "/" $values.runbookBaseUrl) (trimPrefix (printf "%s/" $base) $rule.annotations.runbook_url)) }}
{{- with get $values.for $rule.alert }}
{{- $_ := set $rule "for" . }}
{{- end }}
{{- $labels := merge (dict) $values.additionalAlertLabels ($rule.labels | default dict) }}
{{- with get $values.severity $rule.alert }}
{{- $_ := set $labels "severity" . }}
{{- end }}
{{- $_ := set $rule "labels" $labels }}
{{- toYaml $rule }}
{{- end }}
