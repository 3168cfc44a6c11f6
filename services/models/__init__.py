from services.models.loader import LoadedModel, eos_token_ids, load_model, resolve_model_dir

__all__ = ["LoadedModel", "eos_token_ids", "load_model", "resolve_model_dir"]
