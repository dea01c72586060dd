"""The manifest of upstream SGLang symbols that vToken hooks (data only; see README.md here)."""
