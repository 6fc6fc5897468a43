"""Ranks that disagree fail fast and clearly, on every rank (issue 11, items 5 and 6).

- Construction: DDP, FSDP and Pipeline compare every rank's model structure / settings and raise on
  every rank naming the ranks and the first difference (before any message whose sizes depend on it).
- Steps: at each gradient synchronization DDP and FSDP compare every rank's step stamp (training
  forwards, optimizer steps); the pipeline stamps each boundary message with (step, micro-batch).
The references are the ranks' own inputs: the test decides which rank deviates and checks the message
names exactly that rank and value.
"""

import contextlib

import numpy as np
import pytest

from mpidist import collectives, nn, optim
from mpidist.comm import CommError
from mpidist.guard import DesyncError
from mpidist.parallel.ddp import DDP
from mpidist.parallel.fsdp import FSDP
from mpidist.parallel.pipeline import Pipeline

IN, OUT = 5, 3


def make_model(hidden=7, dtype=np.float64):
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(IN, hidden, rng=rng, dtype=dtype), nn.Tanh(),
                         nn.Linear(hidden, OUT, rng=rng, dtype=dtype))


def batch(step, n=8):
    rng = np.random.default_rng([7, step])
    return rng.standard_normal((n, IN)), rng.integers(0, OUT, size=n)


WRAPPERS = {"ddp": DDP, "fsdp": FSDP}


# -- construction: same model structure ------------------------------------------------------------------
@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_different_model_shapes_raise_on_every_rank(comm, wrapper):
    last = comm.Get_size() - 1
    model = make_model(hidden=9 if comm.Get_rank() == last else 7)
    others = "ranks 0" if last > 1 else "rank 0"
    with pytest.raises(ValueError, match=rf"{wrapper.upper()}: ranks hold different models .* at parameter 0: "
                                         rf"{others}[,\d]*: \('0.weight', \(7, 5\), 'float64'\); "
                                         rf"rank {last}: \('0.weight', \(9, 5\), 'float64'\)"):
        WRAPPERS[wrapper](model, comm)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_different_dtype_or_extra_layer_raise_on_every_rank(comm, wrapper):
    rank = comm.Get_rank()
    model = make_model(dtype=np.float32 if rank == 1 else np.float64)
    with pytest.raises(ValueError, match=r"at parameter 0: .*'float64'\); rank 1: \('0.weight', \(7, 5\), 'float32'\)"):
        WRAPPERS[wrapper](model, comm)
    model = make_model()
    if rank == 0:
        model = nn.Sequential(*model, nn.Linear(OUT, OUT, dtype=np.float64))
    with pytest.raises(ValueError, match=r"at parameter 4 \(parameter counts: rank 0: 6; ranks? 1.*: 4\): "
                                         r"rank 0: \('3.weight'.*<none: only 4 parameters>"):
        WRAPPERS[wrapper](model, comm)


@pytest.mark.world_sizes(2, 4)
def test_check_same_names_a_rank_with_an_empty_list(comm):
    # A count of 0 is a value: the message must name rank 0's empty list, not leave rank 0 out.
    from mpidist.comm.agree import check_same
    others = "rank 1" if comm.Get_size() == 2 else f"ranks 1,2,{comm.Get_size() - 1}"
    with pytest.raises(ValueError, match=rf"^settings: ranks disagree at item 0 \(item counts: rank 0: 0; {others}: 1\): "
                                         rf"rank 0: <none: only 0 items>; {others}: 'a'$"):
        check_same(comm, [] if comm.Get_rank() == 0 else ["a"], "settings")


@pytest.mark.world_sizes(2, 4)
def test_pipeline_settings_must_agree(comm):
    from test_pipeline import split_model
    rank, p = comm.Get_rank(), comm.Get_size()
    chunks, _ = split_model(comm, "1f1b")
    loss = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=rf"Pipeline: ranks were built with different settings: .* at setting 1: "
                                         rf".*\('num_microbatches', 4\); rank {p - 1}: \('num_microbatches', 5\)"):
        Pipeline(chunks[0], comm, 5 if rank == p - 1 else 4, loss_fn=loss)
    with pytest.raises(ValueError, match=r"at setting 0: rank 0: \('schedule', 'gpipe'\); ranks? 1[,\d]*: \('schedule', '1f1b'\)"):
        Pipeline(chunks[0], comm, 4, schedule="gpipe" if rank == 0 else "1f1b", loss_fn=loss)
    Pipeline(chunks[0], comm, 4, loss_fn=loss)  # agreeing ranks build as before


# -- steps: DDP and FSDP compare step stamps at each synchronization ---------------------------------------------
def _step(model, opt, crit, step, rank, size):
    x, y = batch(step, 4 * size)
    opt.zero_grad()
    crit(model(x[rank::size]), y[rank::size]).backward()
    opt.step()


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_skipped_optimizer_step_is_caught_at_the_next_sync(comm, wrapper):
    rank, size = comm.Get_rank(), comm.Get_size()
    model = WRAPPERS[wrapper](make_model(), comm)
    opt, crit = optim.Adam(model.parameters(), lr=0.01), nn.CrossEntropyLoss()
    _step(model, opt, crit, 0, rank, size)
    x, y = batch(1, 4 * size)
    crit(model(x[rank::size]), y[rank::size]).backward()
    if rank != size - 1:  # the last rank skips opt.step(): its parameters would silently diverge
        opt.step()
    ahead = "rank 0" if size == 2 else "ranks 0,1,2"
    # DDP sees it at the synchronization; FSDP already at the next training forward (it gathers there).
    where, backwards, syncs = ("gradient synchronization", 3, 3) if wrapper == "ddp" else ("training forward", 2, 2)
    with pytest.raises(DesyncError, match=rf"{where} #3 \({ahead}: 3 training forwards, {backwards} backwards \({syncs} synchronizing\), 2 optimizer "
                                          rf"steps; rank {size - 1}: 3 training forwards, {backwards} backwards \({syncs} synchronizing\), 1 optimizer steps\)"):
        _step(model, opt, crit, 2, rank, size)


@pytest.mark.world_sizes(2, 3)
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_evaluation_and_accumulation_on_equal_terms_pass(comm, wrapper):
    """No false alarms: rank-0-only evaluation under eval(), equal accumulation under no_sync, join."""
    rank, size = comm.Get_rank(), comm.Get_size()
    model = WRAPPERS[wrapper](make_model(), comm)
    opt, crit = optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss()
    for step in range(3):
        x, y = batch(step, 4 * size)
        opt.zero_grad()
        with model.no_sync():
            crit(model(x[rank::size][:2]), y[rank::size][:2]).backward()
        crit(model(x[rank::size][2:]), y[rank::size][2:]).backward()
        opt.step()
        if rank == 0 and wrapper == "ddp":  # (FSDP's forward gathers: every rank must take part)
            model.eval()
            model(x)  # evaluation on one rank only
            model.train()
    if wrapper == "ddp":  # ranks with different numbers of batches, then back to lockstep
        with model.join(opt):
            for step in range(rank + 1):
                _step(model, opt, crit, 10 + step, rank, size)
        _step(model, opt, crit, 20, rank, size)


@pytest.mark.world_sizes(2, 3)
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_different_accumulation_counts_are_caught(comm, wrapper):
    """A rank that accumulates one micro-batch more would average a different sum of gradients."""
    rank = comm.Get_rank()
    model = WRAPPERS[wrapper](make_model(), comm)
    crit = nn.CrossEntropyLoss()
    x, y = batch(0, 8)
    with model.no_sync():
        for _ in range(2 if rank == 0 else (3 if wrapper == "ddp" else 2)):  # rank 0 accumulates one fewer
            crit(model(x), y).backward()
    others_accumulate = rank != 0 and wrapper == "fsdp"
    with model.no_sync() if others_accumulate else contextlib.nullcontext():
        loss = crit(model(x), y)
    # DDP compares at the synchronization; FSDP at every backward: rank 0's synchronizing one meets
    # the others' third accumulated one (FSDP's forwards and backwards all communicate).
    if wrapper == "ddp":
        where, theirs = "gradient synchronization #1", "4 training forwards, 4 backwards \\(1 synchronizing\\)"
    else:
        # each rank names its own point: rank 0 its synchronization, the others their backward
        where = "(gradient synchronization #1|backward #3 \\(under no_sync\\))"
        theirs = "3 training forwards, 3 backwards \\(0 synchronizing\\)"
    with pytest.raises(DesyncError, match=rf"{wrapper.upper()}: ranks are at different steps at {where} "
                                          rf"\(rank 0: 3 training forwards, 3 backwards \(1 synchronizing\), 0 optimizer "
                                          rf"steps; ranks? 1[,\d]*: {theirs}, 0 optimizer steps\)"):
        if not others_accumulate:
            loss.backward()
        else:  # FSDP: the others' third accumulated backward meets rank 0's synchronizing one
            with model.no_sync():
                loss.backward()


# -- the pipeline: (step, micro-batch) stamped on every boundary message -----------------------------------------
@pytest.mark.world_sizes(1, 2, 3)
@pytest.mark.parametrize("nbytes", [24, 80_000])  # inline in the header's message, and a separate payload
def test_stamped_messages_are_checked_and_consumed(comm, nbytes):
    rank, size = comm.Get_rank(), comm.Get_size()
    dest, source = (rank + 1) % size, (rank - 1) % size
    x = np.arange(nbytes // 8, dtype=np.float64) + rank
    pending = [collectives.isend(x, dest, comm, tag=3, stamp=(5, 1)),
               collectives.isend(x * 2, dest, comm, tag=3, stamp=(6, 0))]
    with pytest.raises(DesyncError, match=rf"recv: the message from rank {source} \(tag 3\) carries stamp \(5, 1\), "
                                          r"but this receive expects stamp \(6, 0\)"):
        collectives.recv(source, comm, tag=3, stamp=(6, 0))
    # The rejected message's payload was taken off the queue: the next message arrives intact.
    expected = (np.arange(nbytes // 8, dtype=np.float64) + source) * 2
    np.testing.assert_array_equal(collectives.recv(source, comm, tag=3, stamp=(6, 0)), expected)
    for handle in pending:
        handle.wait()
    unstamped = collectives.isend(x, dest, comm, tag=4)
    with pytest.raises(DesyncError, match=r"carries no stamp, but this receive expects stamp \(0, 0\)"):
        collectives.irecv(source, comm, tag=4, stamp=(0, 0)).wait()
    unstamped.wait()


@pytest.mark.world_sizes(2)
@pytest.mark.mpi_skip  # one rank raises while the other waits for it: under mpiexec the abort handler ends that
def test_pipeline_rank_at_another_step_is_caught(comm):
    from test_pipeline import split_model, batch as pipe_batch
    rank = comm.Get_rank()
    chunks, _ = split_model(comm, "1f1b")
    loss = nn.CrossEntropyLoss()
    first = Pipeline(chunks[0], comm, 2, loss_fn=loss)
    x, y = pipe_batch(0, 4)
    first.step(x, y)
    first.step(x, y)
    rebuilt = Pipeline(chunks[0], comm, 2, loss_fn=loss)  # rank 1 goes on with a fresh pipeline (step 1)
    with pytest.raises((DesyncError, CommError)) as caught:
        (first if rank == 0 else rebuilt).step(x, y)
    if rank == 1:
        assert caught.type is DesyncError
        assert ("Pipeline.step 1: rank 1 expected micro-batch 0 of this step from rank 0 (stage 0), but the ranks are "
                "at different steps" in str(caught.value)) and "carries stamp (3, 0)" in str(caught.value)


# -- DDP's stamp carried in the last bucket's allreduce ----------------------------------------------------
def test_stamp_sums_tell_equal_counts_from_different_ones():
    """The carried check: sum(c)^2 == N sum(c^2) exactly when all N counts agree (checked against all splits)."""
    from mpidist.parallel.agreement import StepStamp
    for dtype, size in ((np.float16, 2), (np.float16, 8), (np.float32, 64), (np.float64, 4096)):
        m = StepStamp.modulus(dtype, size)
        assert m is not None and size * m * m <= 2.0 ** {2: 11, 4: 24, 8: 53}[np.dtype(dtype).itemsize]
    assert StepStamp.modulus(np.float16, 16) is None  # too few exact integers: the separate check is used
    rng = np.random.default_rng(0)
    for _ in range(200):
        size = int(rng.integers(2, 9))
        counts = np.full(size, int(rng.integers(0, 1000)))
        if rng.random() < 0.5:
            counts[rng.integers(size)] += int(rng.integers(1, 3))
        sums = np.array([counts.sum(), (counts * counts).sum()], dtype=np.float64)
        assert (sums[0] ** 2 == size * sums[1]) == (len(set(counts.tolist())) == 1)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ddp_carries_the_stamp_in_its_last_bucket(comm, dtype):
    """No message of its own where the bucket dtype holds the sums; a skipped step is still caught."""
    rank = comm.Get_rank()
    model = DDP(make_model(dtype=dtype), comm)
    assert model._stamp_mod is not None and model.buckets[-1].stamp_view is not None
    x = np.ones((4, IN), dtype=dtype)
    model(x).sum().backward()
    # The counts went into the bucket (encode ran) and no allreduce of the stamp's own was started.
    assert model._stamp._mine == (1, 1, 1, 0) and model._stamp._handle is None
    if rank == 0:  # an optimizer step the others skip (as mpidist's optimizers record it; SGD refuses float16)
        for p in model.parameters():
            p.version += 1
    model.zero_grad()
    with pytest.raises(DesyncError, match=r"DDP: ranks are at different steps at gradient synchronization #2 "
                                          r"\(rank 0: 2 training forwards, 2 backwards \(2 synchronizing\), 1 optimizer"):
        model(x).sum().backward()
