"""How vToken enters SGLang at start: its options and flags, the SGLang flags, combinations and models it refuses
(one line each, before any weight loads), and the fingerprints of every upstream symbol it hooks."""
