"""Pipeline knowledge, torch-free: each schedule's table (``tables``) and the one replay
engine (``replay``) that the trainer's tests, the theory and the what-if all use."""
