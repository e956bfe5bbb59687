"""Detectors: the out-of-band watchdog (threads) and its probes, the GIL-free liveness helper process
and the learned hang deadline. They stand on :mod:`..core` only."""
