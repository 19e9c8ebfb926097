"""The HTTP layer: the FastAPI app (``app``) and one router per resource (``routes/``)."""
