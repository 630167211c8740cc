"""JSON Schemas for the two custom resources the chart renders, which kubernetes-validate does not ship.

Written for this suite from the fields KEDA (keda.sh/v1alpha1 ScaledObject) and the Prometheus operator
(monitoring.coreos.com/v1 ServiceMonitor) document; closed (``additionalProperties: false``) at every level
the chart writes, so a misspelt field fails. The HPA behaviour inside a ScaledObject is checked separately
against Kubernetes' own HorizontalPodAutoscaler schema.
"""

from __future__ import annotations

from typing import Any

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}},
}
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_QUANTITY_STRING = {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?$"}

_KAFKA_METADATA = {
    "type": "object",
    "required": ["bootstrapServers", "consumerGroup", "topic", "lagThreshold"],
    "properties": {
        "bootstrapServers": {"type": "string", "minLength": 1},
        "consumerGroup": {"type": "string", "minLength": 1},
        "topic": {"type": "string", "minLength": 1},
        "lagThreshold": _QUANTITY_STRING,
        "activationLagThreshold": _QUANTITY_STRING,
        "offsetResetPolicy": {"enum": ["earliest", "latest"]},
        "allowIdleConsumers": {"enum": ["true", "false"]},
        "scaleToZeroOnInvalidOffset": {"enum": ["true", "false"]},
        "excludePersistentLag": {"enum": ["true", "false"]},
        "limitToPartitionsWithLag": {"enum": ["true", "false"]},
    },
    "additionalProperties": False,
}
_PROMETHEUS_METADATA = {
    "type": "object",
    "required": ["serverAddress", "query", "threshold"],
    "properties": {
        "serverAddress": {"type": "string", "pattern": "^https?://"},
        "query": {"type": "string", "minLength": 1},
        "threshold": _QUANTITY_STRING,
        "activationThreshold": _QUANTITY_STRING,
        "ignoreNullValues": {"enum": ["true", "false"]},
        "unsafeSsl": {"enum": ["true", "false"]},
        "namespace": {"type": "string"},
    },
    "additionalProperties": False,
}


def _trigger(kind: str, metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", "metadata"],
        "properties": {
            "type": {"const": kind},
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
            "useCachedMetrics": {"type": "boolean"},
            "authenticationRef": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1}, "kind": {"type": "string"}},
                "additionalProperties": False,
            },
            "metadata": metadata,
        },
        "additionalProperties": False,
    }


SCALED_OBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "envSourceContainerName": {"type": "string"},
                    },
                    "additionalProperties": False,
                },
                "pollingInterval": _INT32,
                "cooldownPeriod": _INT32,
                "initialCooldownPeriod": _INT32,
                "idleReplicaCount": _INT32,
                "minReplicaCount": _INT32,
                "maxReplicaCount": {**_INT32, "minimum": 1},
                "advanced": {
                    "type": "object",
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                            "additionalProperties": False,
                        },
                    },
                    "additionalProperties": False,
                },
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "properties": {"failureThreshold": _INT32, "replicas": _INT32},
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "oneOf": [_trigger("kafka", _KAFKA_METADATA), _trigger("prometheus", _PROMETHEUS_METADATA)]
                    },
                },
            },
            "additionalProperties": False,
        },
    },
}

_LABEL_SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": _STRING_MAP, "matchExpressions": {"type": "array"}},
    "additionalProperties": False,
}

SERVICE_MONITOR: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                    "additionalProperties": False,
                },
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "port": {"type": "string", "minLength": 1},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "scrapeTimeout": {"type": "string"},
                            "honorLabels": {"type": "boolean"},
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
        },
    },
}

CUSTOM_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
}
