"""What launchers read (:mod:`.reports`), the SIGTERM/SIGINT handler (:mod:`.signals`), torchrun's
per-attempt store namespace (:mod:`.compat_torchrun`), the store host (:mod:`.store_host`)."""
