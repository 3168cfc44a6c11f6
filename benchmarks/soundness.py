"""Soundness of the grammars, no model needed: labelled JSON instances walked through them.

Every labelled instance of two corpora is serialized, tokenized with the served model's tokenizer
and fed to a grammar state token by token, then the end-of-sequence token:
- `maskbench`: the 610 dev schemas in `../shared/data/maskbench/` with their valid and invalid
  instances (JSONSchemaBench's real-world subsets);
- `suite`: the JSON-Schema-Test-Suite (drafts 2020-12 and 7; `make suite` unpacks it from the
  `jsonschema` source distribution into `.cache/`), one keyword per file.

An instance counts as accepted when the grammar takes some serialization of it: as written, and
with each object's keys in the order of its schema's `properties` (xgrammar and llguidance enforce
that order, so a valid instance written in another order is not an over-constraint). Per
pipeline, each case is one of: served or not (the schema compiles), valid rejected
(over-constraint), invalid accepted (under-constraint).

Pipelines: `xgrammar` and `llguidance` are the grammar alone, with the engine's default
`StructuredOutput` options; `default` is what a request gets by default: the `auto` backend, then
the check every finished JSON output passes (services/sandbox/validate.py: jsonschema-rs against
the schema the grammar was built from), which turns an accepted but invalid instance into an
error. Counts are split by keyword: the test-suite file, or for maskbench the keyword `jsonschema`
names for an invalid instance's best error.

Writes `benchmarks/results/soundness.json`; `--ratchet` compares the counts with
`benchmarks/soundness_ratchet.json` (they may only fall) and `--update-ratchet` rewrites it.

    .venv/bin/python benchmarks/soundness.py [--corpus maskbench suite] [--pipelines default]
        [--limit N] [--ratchet | --update-ratchet]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jsonschema  # noqa: E402
import jsonschema_rs  # noqa: E402

from services.grammar.backend import CompiledGrammar, GrammarError  # noqa: E402
from services.grammar.backends import Backends, from_folder  # noqa: E402
from services.grammar.structured import StructuredOutput  # noqa: E402
from services.models.loader import resolve_model_dir  # noqa: E402
from services.sandbox.validate import Validators, never_fetch, schema_text  # noqa: E402

MASKBENCH = ROOT.parent / "shared" / "data" / "maskbench"
SUITE = ROOT / ".cache" / "json-schema-test-suite"
SUITE_DRAFTS = {  # the folders read, and the meta-schema a schema of each says it follows
    "draft2020-12": "https://json-schema.org/draft/2020-12/schema",
    "draft7": "http://json-schema.org/draft-07/schema#",
}
RESULTS = ROOT / "benchmarks" / "results"
RATCHET = ROOT / "benchmarks" / "soundness_ratchet.json"
PIPELINES = ("xgrammar", "llguidance", "default")


@dataclass(frozen=True)
class Case:
    corpus: str
    source: str  # the file (and, for the suite, the test group)
    keyword: str
    schema: Any
    instance: Any
    valid: bool


def maskbench_cases(limit: int | None) -> Iterator[Case]:
    for path in sorted(MASKBENCH.glob("*.json"))[:limit]:
        doc = json.loads(path.read_text())
        schema = doc["schema"]
        for test in doc.get("tests", []):
            valid = bool(test["valid"])
            keyword = "valid" if valid else blamed_keyword(schema, test["data"])
            yield Case("maskbench", path.stem, keyword, schema, test["data"], valid)


def blamed_keyword(schema: Any, instance: Any) -> str:
    """The keyword of jsonschema's best error for an invalid instance ('?' when it finds none)."""
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(instance))
    except Exception:  # a schema jsonschema cannot use: the case still counts, unblamed
        return "?"
    return str(error.validator) if error is not None else "?"


def suite_cases(limit: int | None) -> Iterator[Case]:
    if not SUITE.is_dir():
        raise SystemExit(f"{SUITE.relative_to(ROOT)} is missing: run `make suite`")
    for draft, default in SUITE_DRAFTS.items():
        for path in sorted((SUITE / draft).glob("*.json"))[:limit]:
            for group in json.loads(path.read_text()):
                schema = group["schema"]
                if isinstance(schema, dict) and "$schema" not in schema:
                    # draft 7 files rely on the runner to say so (`items` means another thing)
                    schema = {"$schema": default, **schema}
                for test in group["tests"]:
                    source = f"{draft}/{path.stem}: {group['description']}"
                    yield Case(
                        "suite", source, path.stem, schema, test["data"], bool(test["valid"])
                    )


# -- serializations ---------------------------------------------------------------------------


def _resolve(node: Any, root: Any, seen: int = 0) -> Any:
    """A local `$ref` (`#/...`) followed to its target, a few hops at most."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < 8:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return node
        node, seen = target, seen + 1
    return node


def _branches(node: Any, root: Any) -> list[dict[str, Any]]:
    """The node and the subschemas that describe the same value (allOf/anyOf/oneOf, refs)."""
    node = _resolve(node, root)
    if not isinstance(node, dict):
        return []
    found = [node]
    for key in ("allOf", "anyOf", "oneOf"):
        for child in node.get(key) or []:
            found += _branches(child, root)
    return found


def _same(a: Any, b: Any) -> bool:
    """JSON equality (key order aside; `true` is not `1`, `1.0` is `1`)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def in_schema_order(value: Any, schema: Any, root: Any, depth: int = 0) -> Any:
    """`value` written as its schema writes it: each object's keys in the order of its
    `properties`, a value equal to a `const`/`enum` member as that member (key order, `1` for
    `1.0`), other integral floats as integers. The same JSON value in every respect."""
    if depth > 64:
        return value
    branches = _branches(schema, root)
    for branch in branches:
        members = [branch["const"]] if "const" in branch else branch.get("enum") or []
        for member in members if isinstance(members, list) else []:
            if _same(member, value):
                return member
    if isinstance(value, dict):
        order: dict[str, Any] = {}
        for branch in branches:
            for name, sub in (branch.get("properties") or {}).items():
                order.setdefault(name, sub)
        keys = sorted(value, key=lambda k: list(order).index(k) if k in order else len(order))
        return {k: in_schema_order(value[k], order.get(k), root, depth + 1) for k in keys}
    if isinstance(value, list):
        out = []
        for i, item in enumerate(value):
            sub = None
            for branch in branches:
                prefix = branch.get("prefixItems")
                items = branch.get("items")
                if isinstance(prefix, list) and i < len(prefix):
                    sub = prefix[i]
                elif isinstance(items, list) and i < len(items):  # draft 7 tuples
                    sub = items[i]
                elif isinstance(items, dict):
                    sub = items
                if sub is not None:
                    break
            out.append(in_schema_order(item, sub, root, depth + 1))
        return out
    return value


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return [_integral(v) for v in value] if isinstance(value, list) else value


def serializations(case: Case) -> list[str]:
    """The instance as written, in its schema's order, and that with integral floats as ints."""
    ordered = in_schema_order(case.instance, case.schema, case.schema)
    values = (case.instance, ordered, _integral(ordered))
    return list(dict.fromkeys(json.dumps(v, ensure_ascii=False) for v in values))


# -- walking ----------------------------------------------------------------------------------


def _without_formats(node: Any) -> Any:
    if isinstance(node, list):
        return [_without_formats(x) for x in node]
    if not isinstance(node, dict):
        return node
    return {
        k: _without_formats(v)
        for k, v in node.items()
        if not (k == "format" and isinstance(v, str))
    }


class Walker:
    """Compiles each schema once per pipeline and walks texts through fresh grammar states."""

    def __init__(self, backends: Backends) -> None:
        self.backends = backends
        self.tokenizer = backends.tokenizer
        self.eos = int(self.tokenizer.eos_token_id)
        self.validators = Validators()
        self._compiled: dict[tuple[str, str], CompiledGrammar | None] = {}

    def compiled(self, pipeline: str, schema: Any, strict: bool = True) -> CompiledGrammar | None:
        key = (pipeline, json.dumps(schema, sort_keys=True), strict)
        if key not in self._compiled:
            backend = None if pipeline == "default" else pipeline
            try:
                spec = StructuredOutput(json_schema=schema, backend=backend, strict=strict)
                built = self.backends.compile(spec)
            except (GrammarError, ValueError, RecursionError):
                built = None
            self._compiled[key] = built
        return self._compiled[key]

    def grammar_accepts(self, compiled: CompiledGrammar, text: str) -> bool:
        state = self.backends.new_state(compiled)
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            if not state.accept_token(token):
                return False
        return state.accept_token(self.eos) and state.is_terminated()

    def why_rejected(self, pipeline: str, case: Case, texts: list[str]) -> str:
        """'strict' or 'format' when a valid instance is rejected by design, else ''."""
        lifted = self.compiled(pipeline, case.schema, strict=False)
        if lifted is not None and self.accepts(pipeline, lifted, texts):
            return "strict"
        unformatted = _without_formats(case.schema)
        compiled = self.compiled(pipeline, unformatted)
        if compiled is None or not any(self.grammar_accepts(compiled, t) for t in texts):
            return ""
        try:
            loose = jsonschema_rs.validator_for(
                compiled.schema or {}, validate_formats=False, retriever=never_fetch
            )
        except Exception:  # a schema the check cannot use
            return ""
        return "format" if any(loose.is_valid(json.loads(t)) for t in texts) else ""

    def accepts(self, pipeline: str, compiled: CompiledGrammar, texts: list[str]) -> bool:
        for text in texts:
            if not self.grammar_accepts(compiled, text):
                continue
            if pipeline != "default":
                return True
            # the check every finished JSON output passes (structured/validation.py)
            schema = compiled.schema if compiled.schema is not None else {}
            if self.validators.verdict(schema_text(schema), text)[0]:
                return True
        return False


def served_backends() -> Backends:
    """The default model's backends, `auto` (the engine's default) for the default pipeline."""
    return from_folder(str(resolve_model_dir(None)[1]), default="auto")


@dataclass
class Tally:
    """Per pipeline and corpus (or keyword): `valid_rejected` counts the narrowings by design
    apart: strict mode (lifted by `strict: false`), and `format`, which the check asserts where
    the suite reads it as an annotation."""

    cases: int = 0
    not_served: int = 0
    valid: int = 0
    valid_rejected: int = 0
    by_strict_mode: int = 0  # of those, accepted when the request says `strict: false`
    by_format: int = 0  # of those, failing only a `format` the check asserts
    invalid: int = 0
    invalid_accepted: int = 0

    def add(self, served: bool, valid: bool, accepted: bool, why: str = "") -> None:
        self.cases += 1
        if not served:
            self.not_served += 1
        elif valid:
            self.valid += 1
            self.valid_rejected += not accepted
            self.by_strict_mode += not accepted and why == "strict"
            self.by_format += not accepted and why == "format"
        else:
            self.invalid += 1
            self.invalid_accepted += accepted


def run(corpora: list[str], pipelines: list[str], limit: int | None) -> dict[str, Any]:
    walker = Walker(served_backends())
    totals: dict[str, dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
    by_keyword: dict[str, dict[str, dict[str, Tally]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(Tally))
    )
    examples: dict[str, list[dict[str, Any]]] = {p: [] for p in pipelines}
    started, seen = time.monotonic(), 0
    for corpus in corpora:
        cases = maskbench_cases(limit) if corpus == "maskbench" else suite_cases(limit)
        for case in cases:
            texts = serializations(case)
            for pipeline in pipelines:
                compiled = walker.compiled(pipeline, case.schema)
                accepted = compiled is not None and walker.accepts(pipeline, compiled, texts)
                served = compiled is not None
                why = (
                    walker.why_rejected(pipeline, case, texts)
                    if served and case.valid and not accepted
                    else ""
                )
                totals[pipeline][corpus].add(served, case.valid, accepted, why)
                by_keyword[pipeline][corpus][case.keyword].add(served, case.valid, accepted, why)
                if served and accepted != case.valid and not why and len(examples[pipeline]) < 400:
                    examples[pipeline].append(
                        {
                            "corpus": corpus,
                            "source": case.source,
                            "keyword": case.keyword,
                            "valid": case.valid,
                            "text": texts[-1][:300],
                        }
                    )
            seen += 1
            if seen % 500 == 0:
                print(f"  {seen} cases, {time.monotonic() - started:.0f} s", file=sys.stderr)
    return {
        "totals": {p: {c: vars(t) for c, t in per.items()} for p, per in totals.items()},
        "by_keyword": {
            p: {c: {k: vars(t) for k, t in sorted(kw.items())} for c, kw in per.items()}
            for p, per in by_keyword.items()
        },
        "examples": examples,
        "seconds": round(time.monotonic() - started, 1),
    }


COUNTS = ("not_served", "valid_rejected", "invalid_accepted")


def ratchet_of(out: dict[str, Any]) -> dict[str, Any]:
    return {
        p: {c: {k: t[k] for k in COUNTS} for c, t in per.items()}
        for p, per in out["totals"].items()
    }


def over_ratchet(out: dict[str, Any], ratchet: dict[str, Any]) -> list[str]:
    """Each count above its ratchet (for the pipelines and corpora both hold)."""
    worse = []
    for pipeline, per in ratchet_of(out).items():
        for corpus, counts in per.items():
            held = ratchet.get(pipeline, {}).get(corpus)
            for name, value in counts.items() if held else ():
                if value > held[name]:
                    worse.append(f"{pipeline}/{corpus}/{name}: {value} > {held[name]}")
    return worse


def report(out: dict[str, Any]) -> None:
    print(
        f"{'pipeline':<11} {'corpus':<10} {'cases':>6} {'not served':>10} "
        f"{'valid rejected':>15} {'(strict)':>8} {'(format)':>8} {'invalid accepted':>17}"
    )
    for pipeline, per in out["totals"].items():
        for corpus, t in per.items():
            vr = f"{t['valid_rejected']} ({100 * t['valid_rejected'] / max(1, t['valid']):.1f}%)"
            share = 100 * t["invalid_accepted"] / max(1, t["invalid"])
            ia = f"{t['invalid_accepted']} ({share:.1f}%)"
            print(
                f"{pipeline:<11} {corpus:<10} {t['cases']:>6} {t['not_served']:>10} "
                f"{vr:>15} {t['by_strict_mode']:>8} {t['by_format']:>8} {ia:>17}"
            )
    for pipeline, per in out["by_keyword"].items():
        worst = Counter(
            {f"{c}:{k}": t["invalid_accepted"] for c, kw in per.items() for k, t in kw.items()}
        )
        top = ", ".join(f"{k} {n}" for k, n in worst.most_common(8) if n)
        print(f"{pipeline}: invalid accepted by keyword: {top or 'none'}")
    print(f"{out['seconds']} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", nargs="+", default=["maskbench", "suite"])
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    ap.add_argument("--limit", type=int, default=None, help="files per corpus (and draft)")
    ap.add_argument("--ratchet", action="store_true", help="fail when a count is over the ratchet")
    ap.add_argument("--update-ratchet", action="store_true")
    args = ap.parse_args()
    out = run(args.corpus, args.pipelines, args.limit)
    report(out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soundness.json").write_text(json.dumps(out, indent=1))
    if args.update_ratchet:
        RATCHET.write_text(json.dumps(ratchet_of(out), indent=1) + "\n")
    if args.ratchet:
        worse = over_ratchet(out, json.loads(RATCHET.read_text()))
        if worse:
            raise SystemExit("over the ratchet: " + "; ".join(worse))


if __name__ == "__main__":
    main()
