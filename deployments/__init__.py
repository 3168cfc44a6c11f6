"""The Ray Serve application: deployments, the HTTP ingress, the CLI."""

from deployments.local_ray import keep_replicas_on_loopback

keep_replicas_on_loopback()  # a no-op unless this is a Serve replica on a loopback node
