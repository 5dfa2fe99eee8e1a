"""Step scheduler: buckets take turns, requests join at step boundaries, the queue is bounded."""

import pytest

from ditserve.replica.scheduler import Job, QueueFullError, StepScheduler


def job(i, bucket=(64, 64, 1)):
    return Job(req_id=str(i), params=None, bucket=bucket)


def test_requests_of_one_bucket_join_up_to_max_batch():
    s = StepScheduler(max_batch_size=2, max_queue=10)
    jobs = [job(i) for i in range(3)]
    for j in jobs:
        s.submit(j)
    admit, running = s.next_batch()
    assert admit == jobs[:2] and running == []
    for j in admit:
        s.start_running(j)
    admit, running = s.next_batch()
    assert admit == [] and running == jobs[:2]
    s.finish(jobs[0])
    admit, running = s.next_batch()
    assert admit == [jobs[2]] and running == [jobs[1]]


def test_buckets_take_turns():
    s = StepScheduler(max_batch_size=4, max_queue=10)
    a, b = job("a", (64, 64, 1)), job("b", (128, 128, 1))
    s.submit(a)
    s.submit(b)
    seen = []
    for _ in range(4):
        admit, running = s.next_batch()
        for j in admit:
            s.start_running(j)
        seen.append((admit + running)[0].req_id)
    assert seen == ["a", "b", "a", "b"]


def test_queue_full_and_cancel():
    s = StepScheduler(max_batch_size=1, max_queue=2)
    j1, j2 = job(1), job(2)
    s.submit(j1)
    s.submit(j2)
    with pytest.raises(QueueFullError):
        s.submit(job(3))
    admit, _ = s.next_batch()
    s.start_running(admit[0])
    j1.future.cancel()
    j2.future.cancel()
    dropped = s.reap_cancelled()
    assert dropped == [j1]  # admitted ones need their rank state dropped
    assert s.queue_depth == 0 and s.num_running == 0 and s.next_batch() is None
