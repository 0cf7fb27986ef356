"""DataLoader workers: each decodes only its share, and a resume continues the exact batch order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.store.read.dataset import ActivationDataset
from tests.support.reader_stores import committed_rows, make_store

W, SHARD = 8, 256
N = 8 * SHARD


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("w8") / "s.zarr", N, SHARD, W, context=64, seed=11)


def _ds(s, **kw):
    kw = {"batch_size": 100, "seed": 5, "return_meta": True, "shuffle_buffer_rows": 16 * SHARD, **kw}
    return ActivationDataset(s, **kw)


def test_two_workers_each_decode_half_and_together_every_row_once(eight):
    """The rank's share fits one window: before, both workers decoded all of it (issue 22.2)."""
    s, data = eight[0], eight[1]
    ds = _ds(s)
    got = list(ds.loader(2))
    rows = np.concatenate([b["row"].numpy() for b in got])
    assert np.array_equal(np.sort(rows), committed_rows(s))          # N is even: nothing dropped
    acts = torch.cat([b["acts"] for b in got]).float().numpy()
    assert np.array_equal(acts, data[0, rows].astype(np.float32))
    per_worker = ds.decoded_rows[:2]
    # contiguous halves: each decodes N/2 rows plus at most the shard it shares with the other
    assert all(N // 2 <= d <= N // 2 + SHARD for d in per_worker), per_worker
    assert sum(ds.decoded_rows) == sum(per_worker)


@pytest.mark.parametrize("endless", [False, True], ids=["epoch", "endless"])
@pytest.mark.parametrize("buffer", [16 * SHARD, 2 * SHARD], ids=["one-window", "streaming"])
def test_resume_with_workers_after_an_odd_count_gives_the_uninterrupted_batches(eight, buffer, endless):
    """Before: the DataLoader restarted its round-robin at worker 0 and swapped batch pairs."""
    s = eight[0]
    kw = {"shuffle_buffer_rows": buffer, **({"steps": 27} if endless else {})}
    full = list(_ds(s, **kw).loader(2))
    cut = 7
    dl = _ds(s, **kw).loader(2)
    first = []
    for b in dl:
        first.append(b)
        if len(first) == cut:
            break
    state = dl.state_dict()
    again = _ds(s, **kw).loader(2)
    again.load_state_dict(state)
    resumed = first + list(again)
    assert len(resumed) == len(full)
    for a, b in zip(resumed, full):
        assert torch.equal(a["row"], b["row"]) and torch.equal(a["acts"], b["acts"])


def test_what_a_process_holds_stays_bounded_over_endless_epochs(eight):
    """RSS itself is measured in workermem.py; here: the arenas hold at most one window each,
    and the metadata cache its fixed number of columns, after 5 epochs of endless reading."""
    s = eight[0]
    ds = _ds(s, shuffle_buffer_rows=3 * SHARD, exclude_token_ids=[1], steps=5 * N // 100)
    assert sum(1 for _ in ds) == 5 * N // 100
    held = [b.shape[0] for b in ds._arenas._bufs if b is not None]
    assert len(held) == 2 and max(held) <= ds.window_shards * SHARD
    assert len(ds._meta_cols._cache) <= ds._meta_cols._keep



# ---- hand-off through shared-memory slots (handoff.py) ------------------------------------------

@pytest.mark.parametrize("by_value", [False, True], ids=["slots", "default-threshold"])
@pytest.mark.parametrize("normalize", [None, "norm_scale"], ids=["in-place", "copied"])
def test_worker_batches_equal_in_process_batches_as_sets_and_stay_valid_while_held(
        eight, monkeypatch, by_value, normalize):
    """Every batch is kept (list()): no slot may be reused under a held batch, so each must
    still equal the store's rows when read after the epoch; 2 workers' rows are the in-process
    rows as a set, and their batches equal torch's hand-off of the same workers, in order."""
    from harvest.store.read.feed import handoff

    if not by_value:
        monkeypatch.setattr(handoff, "BY_VALUE", 0)   # every tensor through a slot (forked: inherited)
    s, data = eight[0], eight[1]
    ds = _ds(s, normalize=normalize, shuffle_buffer_rows=2 * SHARD)
    dl = ds.loader(2)
    got = list(dl)
    ref_rows = np.concatenate([b["row"].numpy() for b in _ds(s, normalize=normalize,
                                                               shuffle_buffer_rows=2 * SHARD)])
    rows = np.concatenate([b["row"].numpy() for b in got])
    assert np.array_equal(np.sort(rows), np.sort(ref_rows))
    # the same batches, in order, as torch's own hand-off of the same workers
    plain = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert len(plain) == len(got)
    for a, b in zip(plain, got):
        assert torch.equal(a["row"], b["row"]) and torch.equal(a["acts"], b["acts"])
    for b in got:     # every held batch still holds its own rows' values
        want = torch.from_numpy(data[0, b["row"].numpy()].astype(np.float32))
        if normalize:
            c = ds.norm_constants
            want = (want - c.shift[0]) * c.scale[0]
        assert torch.equal(b["acts"].float(), want.to(b["acts"].dtype).float())
    if not by_value:
        # the slots were used (held batches keep every slot: the rest went torch's way)
        assert len(dl.handoff.out) == 2 * handoff.SLOTS
        del got, b
        dl.handoff.release()
        assert not dl.handoff.out and not dl.handoff.rings.flags.any()


def test_abandoned_epochs_free_their_slots_and_a_plain_dataloader_gets_tensors(eight, monkeypatch):
    """Persistent workers: an epoch broken off after 3 batches drops what was in flight; the
    next epoch frees those slots and delivers every row, and a trainer that drops each batch
    keeps reusing the same few slots. A plain DataLoader over the same dataset gets tensors."""
    from harvest.store.read.feed import handoff

    monkeypatch.setattr(handoff, "BY_VALUE", 0)
    s, data = eight[0], eight[1]
    ds = _ds(s, shuffle_buffer_rows=2 * SHARD)
    dl = ds.loader(2, persistent_workers=True)
    held = []
    for b in dl:
        held.append(b)    # kept while the epoch is broken off: their slots stay taken
        if len(held) == 3:
            break
    del b
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        seen = []
        for b in dl:
            want = torch.from_numpy(data[0, b["row"].numpy()].astype(np.float32))
            assert torch.equal(b["acts"].float(), want.to(b["acts"].dtype).float())
            seen.append(b["row"].numpy().copy())
        del b
        assert np.array_equal(np.sort(np.concatenate(seen)), committed_rows(s))
        dl.handoff.release()
        if held:   # the broken-off epoch's batches still hold their slots and their rows
            assert len(dl.handoff.out) >= len(held)
            for h in held:
                want = torch.from_numpy(data[0, h["row"].numpy()].astype(np.float32))
                assert torch.equal(h["acts"].float(), want.to(h["acts"].dtype).float())
            del h
        held = []                 # dropped: every slot free at the next release
    dl.handoff.release()
    assert not dl.handoff.rings.flags.any(), dl.handoff.rings.flags
    plain = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert all(isinstance(b["acts"], torch.Tensor) for b in plain)
    assert np.array_equal(np.sort(np.concatenate([b["row"].numpy() for b in plain])), committed_rows(s))


def test_two_live_iterations_never_share_slots(eight, monkeypatch):
    """Non-persistent workers: an iteration kept alive (its generator held) beside a new one:
    each has its own slots, so both deliver correct rows, interleaved."""
    from harvest.store.read.feed import handoff

    monkeypatch.setattr(handoff, "BY_VALUE", 0)
    s, data = eight[0], eight[1]
    dl = _ds(s, shuffle_buffer_rows=2 * SHARD).loader(2)
    a, b = iter(dl), None
    first = next(a)
    b = iter(dl)
    got = [first]
    for x, y in zip(a, b):
        got += [x, y]
    for g in got:
        want = torch.from_numpy(data[0, g["row"].numpy()].astype(np.float32))
        assert torch.equal(g["acts"].float(), want.to(g["acts"].dtype).float())
