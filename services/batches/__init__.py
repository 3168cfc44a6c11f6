"""The Batch API's parts below the service: tenants' files (files.py)."""
