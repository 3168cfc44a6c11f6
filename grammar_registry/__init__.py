"""Grammar specs, static limits, cache keys, the verdict cache and tenant registrations."""

from grammar_registry.cache import LRUBytes, RedisVerdicts, Verdict
from grammar_registry.limits import GrammarLimits, LimitExceeded, check_limits
from grammar_registry.registrations import RegistrationCaps, RegistrationError, RegistrationStore
from grammar_registry.specs import GrammarOptions, GrammarSpec, grammar_key

__all__ = [
    "GrammarLimits",
    "GrammarOptions",
    "GrammarSpec",
    "LRUBytes",
    "LimitExceeded",
    "RedisVerdicts",
    "RegistrationCaps",
    "RegistrationError",
    "RegistrationStore",
    "Verdict",
    "check_limits",
    "grammar_key",
]
