"""mpidist.elastic: training that survives the loss of ranks, with MPI fault tolerance (ULFM, Open MPI 5).

On a failure every survivor gets one ``RankFailure`` (revoke, shrink, agree), restores its in-memory ``State``
(one class for every layout: plain, DDP, FSDP, hybrid FSDP, tensor parallel, pipelines and meshes) to the last
commit all survivors hold, rebuilds the wrapper on the shrunk communicator and goes on with the global batch
kept (``ElasticSampler``). Where fault tolerance cannot work (MPICH, Open MPI started without
``--with-ft ulfm``, a single process) ``init`` refuses with ``FaultToleranceUnavailable``. See docs/elastic.md.

    job = elastic.init()                       # under `mpiexec --with-ft ulfm`
    state = elastic.State(model, opt, sched, sampler, rngs=[rng])
    job.train(state, lambda comm: DDP(model, comm), step_fn, steps)
"""

from .failure import RankFailure, process_failure, recover
from .fault import Fault, InjectedFault, faults_from_env, install_kill_on_error, parse_fault, parse_faults
from .job import Elastic, init
from .sampler import ElasticSampler
from .state import State
from .support import FaultToleranceUnavailable, check_support, ft_problem

__all__ = ["init", "Elastic", "RankFailure", "FaultToleranceUnavailable", "State", "ElasticSampler", "Fault",
           "InjectedFault", "parse_fault", "parse_faults", "faults_from_env", "install_kill_on_error", "check_support", "ft_problem",
           "process_failure", "recover"]
