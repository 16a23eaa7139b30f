# attnverify.plugin is light: it imports torch and the suite only once --adapter is given. In these tests
# the first --adapter run would then import them inside a pytester in-process run, whose sys.modules
# snapshot drops them again afterwards: torch (a C extension) imported twice in one process crashes, and
# a test that monkeypatches attnverify.isolation would patch a module the next run no longer uses. Load
# what the plugin loads once here, before any snapshot.
import os

import torch
import attnverify.adapters.registry  # noqa: F401
import attnverify.bugs  # noqa: F401
import attnverify.evidence  # noqa: F401
import attnverify.isolation  # noqa: F401
import attnverify.journal  # noqa: F401
import attnverify.probes  # noqa: F401
import attnverify.properties.driver  # noqa: F401
import attnverify.recording  # noqa: F401
import attnverify.reports  # noqa: F401
import attnverify.untested  # noqa: F401

# pytest-xdist's workers share the machine's cores: each worker's torch, and through OMP_NUM_THREADS the
# processes it starts, gets its share (`-n 14` on 16 cores runs 14 x 1 threads, not 14 x 16 that wait on each
# other). A thread count set by the caller is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // _WORKERS))
    torch.set_num_threads(max(1, _cores // _WORKERS))

pytest_plugins = ["pytester"]
