"""The worker's parts: one concern each, composed by :class:`belay.Worker`
(``belay.runner``); the HTTP worker sessions (``belay.http.workers``) use the
same leases, fenced ack and reclaim.

Threads of a running worker, each a supervised :class:`~.service.Service`
(a crash of any stops the worker from claiming and stops it)::

    belay-producer-<queue> ──claim──► Leases ◄──renew / timeouts── belay-heartbeat
            │ (Producers)               ▲
            │ submit                    │ release
            ▼                           │
    belay-exec-<n> ── JobRunner ──► Completer ──batched successes (same thread,
      (ThreadExecutor)  middleware,      │      or the one whose batch is in flight)
                        decide           │ fenced ack (§7)
                                         ▼
                                     PostgreSQL ◄── belay-sweeper (Maintenance:
    belay-poller: wakes idle producers              reclaim, reconcile, prune)
    belay-queues: merges belay_queues rows     belay-cron, belay-listener

One job, from claim to ack:

1. :meth:`.producer.Producer.run` sees free slots and calls
   :func:`.producer.claim_jobs` (``store.claim``, or ``store.claim_admitted``);
2. each job becomes an :class:`.execution.Execution`, held by
   :meth:`.leases.Leases.hold` (from now on the heartbeat renews its lease);
3. :meth:`.executor.ThreadExecutor.submit` queues it for a ``belay-exec`` thread;
4. that thread calls :meth:`.running.JobRunner.run`, which runs the function
   inside the middleware with its :class:`belay.Context`;
5. :meth:`.running.JobRunner.conclude` decides the outcome
   (:func:`belay.outcome.decide`);
6. :meth:`.completer.Completer.ack` writes it with :func:`.completer.ack_on`,
   fenced on the attempt (a success instead joins the batch waiting, which
   this thread writes unless another thread's batch is in flight);
7. :meth:`.running.JobRunner.release` frees the lease and the slot, and the
   producer wakes to claim again.

Modules: :mod:`.execution` (one claimed attempt), :mod:`.service` (a
supervised loop), :mod:`.leases`, :mod:`.producer`, :mod:`.executor`,
:mod:`.running`, :mod:`.completer`, :mod:`.hooks` (``on_job_start`` /
``on_job_end``), :mod:`.maintenance`, :mod:`.pool` (the worker's
connections), :mod:`.queueconfig` (static queues with ``belay_queues`` rows
over them), :mod:`.drain` (running in the caller's thread). See
docs/architecture.md.
"""
