"""The kopf operator: OmniPipeline -> Deployments, Services, ConfigMap, status."""
