"""The SGLang 0.5.23 plugin: the only code that touches SGLang, only through its HookRegistry (see patches/)."""
