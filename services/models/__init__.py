from services.models.loader import LoadedModel, load_model, resolve_model_dir

__all__ = ["LoadedModel", "load_model", "resolve_model_dir"]
