"""The model a run gets when none is named: the demo's, a tiny random model that runs anywhere. A module of its own,
with no imports, so that the option records (``options.Asked``) can name it without importing the registry."""

DEFAULT_MODEL = "flux2-tiny"
