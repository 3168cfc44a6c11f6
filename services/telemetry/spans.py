"""Span names and attribute keys, in one place.

GenAI attributes follow OpenTelemetry semantic conventions **1.37.0** (the first release with
`gen_ai.provider.name`, before the GenAI conventions moved to their own repository): the keys are
spelled out here rather than imported from `opentelemetry.semconv._incubating`, whose GenAI
symbols are deprecated and may move. Project attributes use the `structserve.` prefix.

The span tree of one request:

    chat {served model}                 SERVER  ingress: gen_ai.*, structserve.tenant
    └── structserve.generate            INTERNAL  LLM replica, one per choice
        ├── structserve.grammar.resolve           the replica's provider: cache level, backend
        │   └── structserve.grammar.verdict       the grammar service: cache level, outcome
        ├── structserve.queue                     engine arrival → first scheduled
        ├── structserve.prefill                   first scheduled → first token
        └── structserve.decode                    first token → finished
"""

from __future__ import annotations

SEMCONV_VERSION = "1.37.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"

# gen_ai.* (semconv 1.37.0)
OPERATION_NAME = "gen_ai.operation.name"  # chat | text_completion
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
OUTPUT_TYPE = "gen_ai.output.type"  # text | json
INPUT_MESSAGES = "gen_ai.input.messages"  # opt-in content: only with log_prompts
ERROR_TYPE = "error.type"
HTTP_STATUS = "http.response.status_code"

PROVIDER = "structserve"

# project attributes
TENANT = "structserve.tenant"
REQUEST_ID = "structserve.request_id"
GRAMMAR_KIND = "structserve.grammar.kind"
CACHE_LEVEL = "structserve.grammar.cache_level"  # families.CACHE_LEVELS
GRAMMAR_OUTCOME = "structserve.grammar.outcome"  # ok, or the refusal reason
GRAMMAR_BACKEND = "structserve.grammar.backend"  # xgrammar | llguidance: which one compiled it
COMPILE_SECONDS = "structserve.grammar.compile_s"
PREEMPTIONS = "structserve.preemptions"
FORCED_TOKENS = "structserve.jump_forward.tokens"
TOKENS = "structserve.tokens"
CACHED_TOKENS = "structserve.prefix_cache.cached_tokens"  # prompt tokens the cache served

# span names (the server span is "{gen_ai.operation.name} {model}", with the served model's name
# rather than the client's `model` string, which is `gen_ai.request.model`: names stay few)
GENERATE = "structserve.generate"
GRAMMAR_RESOLVE = "structserve.grammar.resolve"
GRAMMAR_VERDICT = "structserve.grammar.verdict"
QUEUE = "structserve.queue"
PREFILL = "structserve.prefill"
DECODE = "structserve.decode"
