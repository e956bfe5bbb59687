"""What launchers read: torchrun's error files (its "Root Cause"), ``torch.multiprocessing``'s
error files and reports, the SIGTERM/SIGINT handler, and torchrun's per-attempt store namespace.
They stand on :mod:`..core` only."""
