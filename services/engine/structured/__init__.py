"""Structured output inside the engine: each request's grammar from submit to validation
(`manager`), the step's masks (`masks`) and the check of finished outputs (`validation`).
What a grammar is and how it is built lives in `services/grammar/`."""
