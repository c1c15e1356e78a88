"""Everything the operator knows of Kueue, in one package; the rest of the operator calls it
through the names below and knows nothing of Workloads.

A job labelled `kueue.x-k8s.io/queue-name` gets one Kueue Workload; Kueue reserves quota for all
of its pods at once and says so in the Workload's status; the job's group runs only while Kueue
admits it. The pass goes through Kueue in four places:

- the controller's index keeps each job's Workload (`lean_workload`), and a pass starts from a
  `KueueView` (the Workload, the version served, the job's queue and priority labels);
- reads.py completes the view (`read_kueue`: the priority class's value, the admitted flavors);
- the lifecycle's Kueue policy (`gate`) keeps the group stopped while Kueue does not admit it;
- decide.py builds the Workload (`build_workload`), places the pods as admitted
  (`admitted_placement`, `with_placement`) and the writes the Workload is owed
  (`workload_writes`), which the reconciler carries out through kube/.

workload.py reads a Workload (both API versions, v1beta1 and v1beta2); writes.py builds what the
operator writes; placement.py where the pods go; gate.py the policy; reads.py the reads. Pure,
but for reads.py, which calls the reader it is given."""

from .gate import FLAVOR_WAIT_SECONDS, gate
from .placement import Placement, admitted_placement, with_placement
from .reads import read_kueue
from .workload import (
    KUEUE_GROUP,
    KUEUE_VERSION,
    KueueVersionError,
    KueueView,
    choose_kueue_version,
    lean_workload,
    priority_class,
)
from .writes import WorkloadWrite, build_workload, workload_writes

__all__ = ["FLAVOR_WAIT_SECONDS", "KUEUE_GROUP", "KUEUE_VERSION", "KueueVersionError",
           "KueueView", "Placement", "WorkloadWrite", "admitted_placement", "build_workload",
           "choose_kueue_version", "gate", "lean_workload", "priority_class",
           "read_kueue", "with_placement", "workload_writes"]
