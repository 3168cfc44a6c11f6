"""The messages between an LLM replica and its engine core process (core.py, core_client.py).

One module holds every message and the one encoder/decoder pair: msgpack through msgspec, each
message a tagged struct, so a reader gets a typed object or a decode error, never a dict read by
string key. Token ids travel as int32 arrays (bytes), never as one Python object per token.
Sampling parameters, the engine's configuration and grammar verdicts are the engine's own
dataclasses, some holding pydantic models: they cross as pickles inside a typed field (both ends
run the same code).

Replica → core: `Add`, `Abort`, `Reply` (to a core's `Call`), `Inject` (tests' fault hook),
`Stop`. Core → replica: `Ready` (once, after the model loaded), `Outputs` (one per step),
`Beat` (the loop is alive: sent between steps and while idle), `Call` (the grammar service,
which only the replica can reach), `Failed` (the core could not start, or its loop stopped).
"""

from __future__ import annotations

import pickle
from array import array
from typing import Any

import msgspec

from services.engine.params import RequestMetrics, RequestOutput, TokenLogprob


def ids_bytes(ids: list[int]) -> bytes:
    return array("i", ids).tobytes()


def ids_list(raw: bytes) -> list[int]:
    out = array("i")
    out.frombytes(raw)
    return out.tolist()


def pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpickled(raw: bytes) -> Any:
    return pickle.loads(raw)  # our own child process: the same code, a private pipe


class Add(msgspec.Struct, tag=True):
    request_id: str
    prompt: bytes  # int32 token ids: the replica templated and tokenized
    params: bytes  # pickled SamplingParams
    tenant: str
    trace: dict[str, str] = {}  # the replica's generate span: the core admits the request in it
    lora_name: str = ""  # an adapter (services/lora): its engine name and local folder
    lora_path: str = ""


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Reply(msgspec.Struct, tag=True):
    call: int
    value: bytes = b""  # pickled result
    error: bytes = b""  # pickled exception (raised in the core's calling thread)


class Inject(msgspec.Struct, tag=True):
    """A fault for tests: `hang` stops the loop for `seconds`; `exit` ends the process."""

    kind: str
    seconds: float = 0.0


class Stop(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    limits: bytes  # pickled admission.Limits: what the replica checks before sending


class Output(msgspec.Struct):
    """What is new for one request since its last output (RequestOutput's delta, not its
    totals: the client keeps the totals)."""

    request_id: str
    delta_text: str
    delta_ids: bytes
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    warnings: list[str]
    validated: bool | None
    error_status: int | None
    new_logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[float] | None


class Outputs(msgspec.Struct, tag=True):
    items: list[Output]


class Beat(msgspec.Struct, tag=True):
    """The loop is alive (a hang is time without beats)."""

    steps: int  # steps run so far
    metrics: bytes = b""  # the core's metrics (pickled snapshot), at most once a second


class Call(msgspec.Struct, tag=True):
    call: int
    method: str  # a VerdictSource method the replica runs on its grammar service handle
    args: bytes  # pickled tuple
    trace: dict[str, str] = {}  # the calling span (a grammar's resolve): the call joins it


class Failed(msgspec.Struct, tag=True):
    error: str


ToCore = Add | Abort | Reply | Inject | Stop
FromCore = Ready | Outputs | Beat | Call | Failed

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: ToCore | FromCore) -> bytes:
    return _encoder.encode(message)


def decode_to_core(raw: bytes) -> ToCore:
    message: ToCore = _to_core.decode(raw)
    return message


def decode_from_core(raw: bytes) -> FromCore:
    message: FromCore = _from_core.decode(raw)
    return message


def output_of(out: RequestOutput, sent_logprobs: int) -> Output:
    """The core's side: a step's `RequestOutput` as a delta; `sent_logprobs` of its logprobs
    went out before."""
    new = out.logprobs[sent_logprobs:] if out.logprobs is not None else None
    return Output(
        request_id=out.request_id,
        delta_text=out.delta_text,
        delta_ids=ids_bytes(out.delta_token_ids),
        finished=out.finished,
        finish_reason=out.finish_reason,
        metrics=out.metrics,
        warnings=out.warnings,
        validated=out.validated,
        error_status=out.error_status,
        new_logprobs=new,
        prompt_logprobs=out.prompt_logprobs,
    )


class Totals:
    """The client's side: one request's totals, rebuilt into the `RequestOutput` the engine
    made in-process (the same fields, so the replica reads either alike)."""

    def __init__(self, request_id: str, prompt_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] | None = None

    def add(self, o: Output) -> RequestOutput:
        delta = ids_list(o.delta_ids)
        self.ids.extend(delta)
        self.text += o.delta_text
        if o.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + o.new_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            text=self.text,
            token_ids=list(self.ids),
            finished=o.finished,
            finish_reason=o.finish_reason,  # type: ignore[arg-type]
            delta_text=o.delta_text,
            delta_token_ids=delta,
            metrics=o.metrics,
            warnings=o.warnings,
            validated=o.validated,
            error_status=o.error_status,
            prompt_logprobs=o.prompt_logprobs,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )
