"""An example Celery app whose tasks each run in a throwaway PandaStack sandbox (docs/celery.md)."""
