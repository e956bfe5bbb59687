"""The real CPython 3.11.7 fork hang (gh-112275) against RestartableDataLoader: ``python bench/dataloader_fork_hang.py SECONDS``.

A native thread keeps entering Python through a ctypes callback (``PyGILState_Ensure`` takes the thread-list
lock without the GIL) while the loader forks 4 workers per pass, pass after pass. A fork at the wrong moment
leaves the child waiting forever on that lock in ``PyOS_AfterFork_Child`` (before its first Python line);
torch waits for its first batch with no limit: without the start check the pass would never end.
Prints the passes, whether each gave the right batches, and the restarts (``stuck at its start``). Set ``FTH_WORKER_START_SEC=2`` to see it sooner.
Measured on 3.11.7, 2 shared cores, three runs of 120-180 s: a stuck worker at pass 279 and at pass 570 (about
1,100 and 2,300 forks; the child's stack: ``_PyThreadState_DeleteExcept`` in a futex wait), each restarted, and
none in 1,516 passes; every pass right (docs/dataloader.md, "How").
"""
import ctypes, json, logging, sys, threading, time
import torch
from torch.utils.data import Dataset
from fault_tolerant_handlers.dataloader import RestartableDataLoader

logging.basicConfig(level=logging.WARNING)
libc = ctypes.CDLL(None, use_errno=True)
START = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)

@START
def start(arg):
    return None

def native_threads():
    tid = ctypes.c_ulong()
    while True:
        if libc.pthread_create(ctypes.byref(tid), None, start, None) == 0:
            libc.pthread_join(tid, None)

class Samples(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return i

threading.Thread(target=native_threads, daemon=True).start()
loader = RestartableDataLoader(Samples(), batch_size=2, num_workers=4, max_restarts=1000)
end, passes, bad = time.monotonic() + float(sys.argv[1]), 0, 0
while time.monotonic() < end:
    got = [b.tolist() for b in loader]
    bad += got != [[0, 1], [2, 3], [4, 5], [6, 7]]
    passes += 1
print(json.dumps({"passes": passes, "forks": passes * 4 + 4 * len(loader.restarts), "wrong_passes": bad,
                  "restarts": [r.describe() for r in loader.restarts]}), flush=True)
