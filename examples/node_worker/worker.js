#!/usr/bin/env node
// A belay worker in Node.js, over the HTTP worker protocol of `belay serve`
// (docs/http.md). No dependencies: Node 18+ has fetch built in.
//
//   BELAY_HTTP_URL   the server, default http://127.0.0.1:8080
//   BELAY_TOKEN      the server's bearer token (belay serve --token-file), if it has one
//   BELAY_QUEUE      the queue to claim from, default "default"
//   BELAY_CAPACITY   how many jobs to run at once, default 4
//
// One line per event goes to stdout: "registered ...", "claimed job N ...",
// "started job N ...", "ran job N task T attempt A -> ok|failed: ...", "stopped".
'use strict';

const BASE = (process.env.BELAY_HTTP_URL || 'http://127.0.0.1:8080').replace(/\/+$/, '');
const SERVER_TOKEN = process.env.BELAY_TOKEN || '';
const QUEUE = process.env.BELAY_QUEUE || 'default';
const CAPACITY = Number.parseInt(process.env.BELAY_CAPACITY || '4', 10);
const RUNTIME_ID = `node-${process.pid}`;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const log = (line) => console.log(line);

// -- The task table: a job's task (belay's job kind) -> async (args, job) => result ----------

const TASKS = {
  'node.echo': async (args) => args,
  'node.add': async ({ a, b }) => {
    if (typeof a !== 'number' || typeof b !== 'number') {
      throw new TypeError(`node.add needs numbers a and b, got ${JSON.stringify({ a, b })}`);
    }
    return a + b;
  },
  // Sleeps args.ms; with args.fast_after_attempt = n, attempts after the n-th don't sleep.
  'node.slow': async (args, job) => {
    const fast = args.fast_after_attempt !== undefined && job.attempt > args.fast_after_attempt;
    const ms = fast ? 0 : Number(args.ms) || 0;
    await sleep(ms);
    return { slept_ms: ms };
  },
  'node.fail': async (args) => {
    throw new Error(args.message || 'node.fail always fails');
  },
};

// -- HTTP ------------------------------------------------------------------------------

// One JSON request; resolves to { status, body } for any HTTP answer, rejects on a
// network error (connection refused, reset, timeout). Every POST is JSON, `{}` when it
// has nothing to send: the server answers 415 to a POST of any other Content-Type.
async function call(method, path, { body, bearer, timeoutMs = 10000 } = {}) {
  const headers = { accept: 'application/json' };
  if (body === undefined && method === 'POST') body = {};
  if (body !== undefined) headers['content-type'] = 'application/json';
  if (bearer) headers.authorization = `Bearer ${bearer}`;
  const response = await fetch(BASE + path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(timeoutMs),
  });
  const text = await response.text();
  let parsed = null;
  try {
    parsed = text ? JSON.parse(text) : null;
  } catch {
    parsed = { error: { message: text } };
  }
  return { status: response.status, body: parsed };
}

const errorOf = (body) => (body && body.error && body.error.message) || JSON.stringify(body);

// Retry delays after network errors or 5xx answers: 0.5 s doubling to 10 s.
class Backoff {
  constructor() { this.ms = 500; }
  reset() { this.ms = 500; }
  async wait(why) {
    log(`${why}; retrying in ${this.ms} ms`);
    await sleep(this.ms);
    this.ms = Math.min(this.ms * 2, 10000);
  }
}

// -- The worker ------------------------------------------------------------------------

let session = null; // { token, waitMs } once registered
let stopping = false;
const inflight = new Set();
const backoff = new Backoff();

async function register() {
  const body = { runtime_id: RUNTIME_ID, tasks: Object.keys(TASKS), capacity: CAPACITY, queue: QUEUE };
  while (!stopping) {
    let res;
    try {
      res = await call('POST', '/workers', { body, bearer: SERVER_TOKEN });
    } catch (err) {
      await backoff.wait(`cannot register with ${BASE}: ${err.cause?.code || err.message}`);
      continue;
    }
    if (res.status === 201) {
      backoff.reset();
      // Claim more often than the session expires (a claim is what keeps it alive), and
      // at most every 10 s so that SIGTERM, which lets the pending claim finish, is quick.
      const ttlMs = res.body.session_ttl_s * 1000;
      const waitMs = Math.max(0, Math.min(res.body.max_wait_ms ?? 20000, 10000, Math.floor(ttlMs / 2)));
      session = { token: res.body.worker_token, waitMs };
      log(`registered runtime ${RUNTIME_ID} queue ${QUEUE} tasks ${res.body.tasks.join(',')} ` +
          `capacity ${CAPACITY} session_ttl ${res.body.session_ttl_s}s`);
      return;
    }
    if (res.status >= 500) {
      await backoff.wait(`register answered ${res.status}: ${errorOf(res.body)}`);
      continue;
    }
    // 400 or 401: a configuration mistake (bad capacity/queue, missing BELAY_TOKEN) - no retry.
    log(`cannot register (${res.status}): ${errorOf(res.body)}`);
    process.exit(2);
  }
}

// Report started/complete; network errors and 5xx are retried, 401/409 drop the outcome
// (the server reclaims the job after its lease lapses and runs it again).
async function report(path, body, what) {
  const token = session && session.token;
  for (let tries = 0; tries < 6; tries++) {
    let res;
    try {
      res = await call('POST', path, { body, bearer: token });
    } catch (err) {
      await backoff.wait(`${what}: network error ${err.cause?.code || err.message}`);
      continue;
    }
    if (res.status === 200) return true;
    if (res.status === 409) {
      log(`stale ${what}: ${errorOf(res.body)}`);
      return false;
    }
    if (res.status === 401) {
      log(`${what}: session expired, outcome dropped (the server will retry the job)`);
      return false;
    }
    if (res.status < 500) {
      log(`${what}: refused (${res.status}): ${errorOf(res.body)}`);
      return false;
    }
    await backoff.wait(`${what}: server answered ${res.status}`);
  }
  log(`${what}: gave up reporting`);
  return false;
}

async function run(event) {
  const { execution_id: executionId, job_id: jobId, task, args, attempt } = event;
  const label = `job ${jobId} task ${task} attempt ${attempt}`;
  await report('/workers/started', { execution_id: executionId }, `started ${label}`);
  log(`started ${label}`);
  let completion;
  try {
    const handler = TASKS[task];
    if (!handler) throw new Error(`this worker has no handler for task ${task}`);
    const result = await handler(args || {}, event);
    completion = { execution_id: executionId, outcome: 'success', result: result ?? null };
    log(`ran ${label} -> ok`);
  } catch (err) {
    const error = { message: String(err && err.message ? err.message : err),
                    type: (err && err.name) || 'Error' };
    if (err && err.stack) error.traceback = String(err.stack).slice(0, 4000);
    completion = { execution_id: executionId, outcome: 'failure', error };
    log(`ran ${label} -> failed: ${error.type}: ${error.message}`);
  }
  await report('/workers/complete', completion, `complete ${label}`);
}

async function claimLoop() {
  while (!stopping) {
    if (!session) {
      await register();
      continue;
    }
    // Claim even while jobs run: the server hands out at most `capacity` at once, and
    // each claim keeps the session (and the leases of its jobs) alive.
    let res;
    try {
      res = await call('POST', `/queues/${encodeURIComponent(QUEUE)}/claim`, {
        body: { wait_ms: session.waitMs }, bearer: session.token, timeoutMs: session.waitMs + 10000,
      });
    } catch (err) {
      await backoff.wait(`claim: network error ${err.cause?.code || err.message}`);
      continue;
    }
    if (res.status === 200) {
      backoff.reset();
      log(`claimed job ${res.body.job_id} task ${res.body.task} attempt ${res.body.attempt}`);
      const job = run(res.body).finally(() => inflight.delete(job));
      inflight.add(job);
    } else if (res.status === 204) {
      backoff.reset();
    } else if (res.status === 401) {
      log('session expired; registering again');
      session = null;
    } else if (res.status >= 500) {
      await backoff.wait(`claim answered ${res.status}: ${errorOf(res.body)}`);
    } else {
      log(`claim refused (${res.status}): ${errorOf(res.body)}`);
      process.exit(2);
    }
  }
}

async function shutdown() {
  log(`stopping: finishing ${inflight.size} job(s)`);
  await Promise.allSettled([...inflight]);
  if (session) {
    try {
      await call('DELETE', '/workers', { bearer: session.token });
    } catch (err) {
      log(`closing the session failed: ${err.cause?.code || err.message}`);
    }
  }
  log('stopped');
}

function onSignal(name) {
  if (stopping) {
    log(`${name} again: exiting now; the server retries unfinished jobs after their leases lapse`);
    process.exit(1);
  }
  log(`${name}: no more claims`);
  stopping = true;
}

if (!Number.isInteger(CAPACITY) || CAPACITY < 1) {
  console.error(`BELAY_CAPACITY must be a positive integer, got ${process.env.BELAY_CAPACITY}`);
  process.exit(2);
}
process.on('SIGTERM', () => onSignal('SIGTERM'));
process.on('SIGINT', () => onSignal('SIGINT'));
claimLoop().then(shutdown).then(() => process.exit(0));
