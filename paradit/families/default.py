"""The model a run gets when none is named; no imports, so the option records name it without the registry."""

DEFAULT_MODEL = "flux2-tiny"
