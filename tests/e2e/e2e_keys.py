"""The test tenants' API keys (the service only ever sees their sha256)."""

KEY_A, KEY_B, KEY_SLOW = "sk-test-tenant-a", "sk-test-tenant-b", "sk-test-limited"
KEY_ONE = "sk-test-one-at-a-time"
