"""Sandbox templates: their definitions (``registry``), built Python environments (``build``) and
the template-carried engine environment (``pythonenv``)."""
