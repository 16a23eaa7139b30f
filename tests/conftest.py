# attnverify.plugin is light: it imports torch and the suite only once --adapter is given. In these tests
# the first --adapter run would then import them inside a pytester in-process run, whose sys.modules
# snapshot drops them again afterwards: torch (a C extension) imported twice in one process crashes, and
# a test that monkeypatches attnverify.isolation would patch a module the next run no longer uses. Load
# what the plugin loads once here, before any snapshot.
import torch  # noqa: F401
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

pytest_plugins = ["pytester"]
