"""What launchers read: torchrun's and ``torch.multiprocessing``'s error files and a spawned rank's
report (:mod:`.reports`), the SIGTERM/SIGINT handler (:mod:`.signals`), torchrun's per-attempt store
namespace and the rendezvous of a recovery in place (:mod:`.compat_torchrun`), the store host
(:mod:`.store_host`). They stand on :mod:`..core` only; their parts of the core's hooks are wired in
:mod:`..wiring`."""
