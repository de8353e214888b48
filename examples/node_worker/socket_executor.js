#!/usr/bin/env node
// A belay executor in Node.js, over Executor Protocol v1 on the Unix-domain socket of
// `belay worker --executor-socket` (docs/executors.md). No dependencies: Node's own `net`.
// The worker claims, leases, renews and acks each job; this process only runs it.
//
//   node socket_executor.js [SOCKET_PATH] [--max-concurrency N]
//
//   BELAY_SOCKET_PATH        the socket when no path is given (else belay's default places)
//   BELAY_MAX_CONCURRENCY    jobs run at once, default 4 (--max-concurrency wins)
//   BELAY_RUNTIME_ID         this process's name in the worker's logs, default node-<pid>
//   BELAY_SHUTDOWN_GRACE_MS  how long SIGTERM waits for running jobs, default 10000
//   BELAY_BLOCK_RETURNS      "1": the node.block task returns at once instead of blocking
//
// One line per event goes to stdout: "connected ...", "registered ...", "started job N ...",
// "ran job N task T attempt A -> ok|failed: ...", "aborted job N ... (reason)",
// "abandoned job N ..." (at shutdown), "stopped".
// Errors go to stderr. It can also be require()d: it then exports its frame codec.
'use strict';

const fs = require('fs');
const net = require('net');
const path = require('path');
const { setTimeout: sleep } = require('timers/promises');

const VERSION = 1;
const MAX_FRAME_BYTES = 1024 * 1024; // a frame's JSON payload, either way
const MAX_REQUEST_ID_BYTES = 128;
const MAX_ERROR_BYTES = 16000; // belay refuses an error object over 16384 bytes as JSON

const log = (line) => console.log(line);
const warn = (line) => console.error(line);

// -- The task table: a job's task (belay's job kind) -> async (args, job, signal) => result --
//
// The first four are worker.js's, so either example runs the same jobs. `signal` is an
// AbortSignal: it fires when belay sends cancel_execution (an operator's cancel, the job's
// timeout) or the executor stops. A handler that ignores it is left to finish in the
// background; its outcome is dropped.

const TASKS = {
  'node.echo': async (args) => args,
  'node.add': async ({ a, b }) => {
    if (typeof a !== 'number' || typeof b !== 'number') {
      throw new TypeError(`node.add needs numbers a and b, got ${JSON.stringify({ a, b })}`);
    }
    return a + b;
  },
  // Sleeps args.ms; with args.fast_after_attempt = n, attempts after the n-th don't sleep.
  'node.slow': async (args, job, signal) => {
    const fast = args.fast_after_attempt !== undefined && job.attempt > args.fast_after_attempt;
    const ms = fast ? 0 : Number(args.ms) || 0;
    await sleep(ms, undefined, { signal });
    return { slept_ms: ms };
  },
  'node.fail': async (args) => {
    throw new Error(args.message || 'node.fail always fails');
  },
  // Prints "blocking job N", then waits until it is aborted (a cancel, SIGTERM), unless
  // BELAY_BLOCK_RETURNS=1: then it returns at once. The tests kill it mid-job.
  'node.block': async (args, job, signal) => {
    log(`blocking job ${job.job_id}`);
    if (process.env.BELAY_BLOCK_RETURNS === '1') return { blocked: false, job_id: job.job_id };
    await new Promise((resolve, reject) => {
      if (signal.aborted) reject(signal.reason);
      signal.addEventListener('abort', () => reject(signal.reason), { once: true });
    });
    return null; // never reached
  },
};

// -- Frames ------------------------------------------------------------------------------
//
// A frame is a 4-byte unsigned big-endian payload length, then that many bytes of a UTF-8
// JSON object with "version": 1, a "type" and a "request_id" (belay/protocol.py).

class ProtocolError extends Error {
  constructor(message) { super(message); this.name = 'ProtocolError'; }
}

// One frame holding `message`; throws ProtocolError when its payload is over the limit.
function encode(message, maxFrameBytes = MAX_FRAME_BYTES) {
  const payload = Buffer.from(JSON.stringify(message), 'utf8');
  if (payload.length > maxFrameBytes) {
    throw new ProtocolError(`the message is ${payload.length} bytes; a frame carries at most ` +
                            `${maxFrameBytes}`);
  }
  const header = Buffer.alloc(4);
  header.writeUInt32BE(payload.length, 0);
  return Buffer.concat([header, payload]);
}

const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

// The message in one frame's payload, checked like belay checks what it receives.
function decode(payload) {
  let message;
  try {
    message = JSON.parse(utf8.decode(payload));
  } catch (err) {
    throw new ProtocolError(`the frame is not UTF-8 JSON: ${err.message}`);
  }
  if (message === null || typeof message !== 'object' || Array.isArray(message)) {
    throw new ProtocolError('a frame holds a JSON object');
  }
  if (message.version !== VERSION) {
    throw new ProtocolError(`version must be ${VERSION}, got ${JSON.stringify(message.version)}`);
  }
  if (typeof message.type !== 'string') throw new ProtocolError('the message has no type');
  const id = message.request_id;
  if (typeof id !== 'string' || id === '' || Buffer.byteLength(id) > MAX_REQUEST_ID_BYTES) {
    throw new ProtocolError(`request_id must be a nonempty string of at most ` +
                            `${MAX_REQUEST_ID_BYTES} UTF-8 bytes`);
  }
  return message;
}

// Cuts a byte stream into messages. The socket hands over chunks wherever it likes: a
// length prefix may be split across two chunks, one chunk may hold several frames.
// push(chunk) returns every message complete so far and keeps the rest. The length is
// checked before any of the payload is buffered up: a frame of 0 or over maxFrameBytes
// throws ProtocolError, and the reader (like its connection) is then unusable.
class FrameReader {
  constructor(maxFrameBytes = MAX_FRAME_BYTES) {
    this.maxFrameBytes = maxFrameBytes;
    this.chunks = []; // received, not yet a whole frame; joined only when needed
    this.size = 0;
    this.broken = null;
  }

  push(chunk) {
    if (this.broken) throw this.broken;
    if (chunk.length) {
      this.chunks.push(chunk);
      this.size += chunk.length;
    }
    const messages = [];
    while (this.size >= 4) {
      const length = this._head(4).readUInt32BE(0);
      if (length === 0 || length > this.maxFrameBytes) {
        this.broken = new ProtocolError(length === 0 ? 'an empty frame' :
          `a frame of ${length} bytes; at most ${this.maxFrameBytes} are allowed`);
        throw this.broken;
      }
      if (this.size < 4 + length) break; // the rest of this frame comes in later chunks
      const payload = Buffer.from(this._head(4 + length).subarray(4)); // a copy: ours now
      this._drop(4 + length);
      try {
        messages.push(decode(payload));
      } catch (err) {
        this.broken = err;
        throw err;
      }
    }
    return messages;
  }

  // The first n buffered bytes as one Buffer (chunks are joined when n straddles them).
  _head(n) {
    if (this.chunks[0].length < n) this.chunks = [Buffer.concat(this.chunks, this.size)];
    return this.chunks[0].subarray(0, n);
  }

  _drop(n) {
    const rest = this.chunks[0].subarray(n);
    if (rest.length) this.chunks[0] = rest;
    else this.chunks.shift();
    this.size -= n;
  }
}

// -- Configuration -----------------------------------------------------------------------

// The socket path as belay resolves it (belay/socketpath.py): the argument,
// $BELAY_SOCKET_PATH, /run/belay/belay.sock when /run/belay exists,
// $XDG_RUNTIME_DIR/belay/belay.sock, $TMPDIR/belay-<uid>/belay.sock, /tmp/belay-<uid>/belay.sock.
function socketPath(explicit) {
  if (explicit) return explicit;
  const env = process.env;
  if (env.BELAY_SOCKET_PATH) return env.BELAY_SOCKET_PATH;
  const usable = (dir) => {
    try {
      fs.accessSync(dir, fs.constants.W_OK | fs.constants.X_OK);
      return path.isAbsolute(dir) && fs.statSync(dir).isDirectory();
    } catch {
      return false;
    }
  };
  try {
    if (fs.statSync('/run/belay').isDirectory()) return '/run/belay/belay.sock';
  } catch { /* not there */ }
  const uid = process.getuid();
  if (env.XDG_RUNTIME_DIR && usable(env.XDG_RUNTIME_DIR)) {
    return path.join(env.XDG_RUNTIME_DIR, 'belay', 'belay.sock');
  }
  if (env.TMPDIR && usable(env.TMPDIR)) return path.join(env.TMPDIR, `belay-${uid}`, 'belay.sock');
  return `/tmp/belay-${uid}/belay.sock`;
}

function parseArgs(argv) {
  const options = { path: null, maxConcurrency: process.env.BELAY_MAX_CONCURRENCY || '4' };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '--max-concurrency') options.maxConcurrency = argv[++i];
    else if (arg.startsWith('--max-concurrency=')) options.maxConcurrency = arg.split('=')[1];
    else if (arg === '-h' || arg === '--help') {
      log('usage: node socket_executor.js [SOCKET_PATH] [--max-concurrency N]');
      process.exit(0);
    } else if (!arg.startsWith('-') && options.path === null) options.path = arg;
    else {
      warn(`unknown argument ${arg}; usage: node socket_executor.js [SOCKET_PATH] ` +
           '[--max-concurrency N]');
      process.exit(2);
    }
  }
  const n = Number(options.maxConcurrency);
  if (!Number.isInteger(n) || n < 1 || n > 65535) {
    warn(`max concurrency must be a whole number from 1 to 65535, got ${options.maxConcurrency}`);
    process.exit(2);
  }
  options.maxConcurrency = n;
  options.path = socketPath(options.path);
  return options;
}

// -- A connection: frames in and out, replies matched to requests by request_id -----------

class ConnectionClosed extends Error {
  constructor() { super('the connection to the worker closed'); this.name = 'ConnectionClosed'; }
}

// An `error` reply: code is invalid_request, stale_execution, unavailable, ...
class ServerError extends Error {
  constructor(body) {
    super(`${body.code}: ${body.message || ''}`);
    this.name = 'ServerError';
    this.code = body.code;
  }
}

class Connection {
  constructor(socket, onMessage) {
    this.socket = socket;
    this.reader = new FrameReader();
    this.waiting = new Map(); // request_id -> { resolve, reject }
    this.ids = 0;
    this.closed = false;
    this.nodeId = null;
    // This connection's executions by execution_id, the ones waiting for a free slot,
    // and the ones running.
    this.executions = new Map();
    this.queued = [];
    this.running = new Set();
    this.done = new Promise((resolve) => {
      socket.on('close', () => {
        this.closed = true;
        for (const { reject } of this.waiting.values()) reject(new ConnectionClosed());
        this.waiting.clear();
        resolve();
      });
    });
    socket.on('error', (err) => warn(`socket error: ${err.code || err.message}`));
    socket.on('data', (chunk) => {
      let messages;
      try {
        messages = this.reader.push(chunk);
      } catch (err) {
        // A broken frame (too large, not JSON, wrong version): as belay does, close this
        // connection; its jobs go back to their queues. We connect again.
        warn(`the worker sent a broken frame (${err.message}); closing the connection`);
        socket.destroy();
        return;
      }
      for (const message of messages) {
        if (this.closed) return;
        const waiter = this.waiting.get(message.request_id);
        if (['ok', 'hello_ok', 'tasks_ok', 'error'].includes(message.type) && waiter) {
          this.waiting.delete(message.request_id);
          if (message.type === 'error') waiter.reject(new ServerError(message.error || {}));
          else waiter.resolve(message);
        } else {
          onMessage(this, message);
        }
      }
    });
  }

  // Send a request; resolves with its reply, rejects with ServerError or ConnectionClosed.
  // A message too large for a frame throws ProtocolError and nothing is sent.
  request(type, fields = {}) {
    if (this.closed) return Promise.reject(new ConnectionClosed());
    const requestId = `${type}-${++this.ids}`;
    const frame = encode({ version: VERSION, type, request_id: requestId, ...fields });
    return new Promise((resolve, reject) => {
      this.waiting.set(requestId, { resolve, reject });
      this.socket.write(frame);
    });
  }
}

// Connect to the socket; rejects with the OS error (ENOENT, ECONNREFUSED, ...).
function connect(socketPathname) {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ path: socketPathname });
    socket.once('connect', () => { socket.removeListener('error', reject); resolve(socket); });
    socket.once('error', reject);
  });
}

// -- Running executions ----------------------------------------------------------------------

let options;
let stopping = false;
const stopController = new AbortController(); // aborts backoff sleeps on SIGTERM
let current = null; // the Connection, once its hello was accepted

// An error object as belay takes it: message, type, traceback; at most 16000 bytes as JSON.
function errorObject(err) {
  const error = {
    message: String(err && err.message !== undefined ? err.message : err).slice(0, 4000),
    type: (err && err.name) || 'Error',
  };
  if (err && err.stack) error.traceback = String(err.stack).slice(0, 8000);
  while (Buffer.byteLength(JSON.stringify(error)) > MAX_ERROR_BYTES) {
    if (error.traceback) error.traceback = error.traceback.slice(0, error.traceback.length >> 1);
    else error.message = error.message.slice(0, error.message.length >> 1);
  }
  return error;
}

// Settles like `promise`, or rejects with the signal's reason as soon as it is aborted
// (so a handler that ignores its signal can't hold the slot).
function untilAborted(promise, signal) {
  return new Promise((resolve, reject) => {
    const onAbort = () => reject(signal.reason);
    if (signal.aborted) return onAbort();
    signal.addEventListener('abort', onAbort, { once: true });
    promise.then(resolve, reject).finally(() => signal.removeEventListener('abort', onAbort));
  });
}

// Report an outcome. `unavailable` (the worker's database didn't answer; nothing was
// written) is retried; a lost connection drops it: the worker gives the job back.
async function report(conn, type, fields, label) {
  for (let tries = 1; ; tries++) {
    try {
      return await conn.request(type, fields);
    } catch (err) {
      if (err instanceof ServerError && err.code === 'unavailable' && tries < 6) {
        warn(`${type} ${label}: ${err.message}; reporting again`);
        await sleep(250 * 2 ** tries);
        continue;
      }
      throw err;
    }
  }
}

// After cancel_execution, belay has already ended the attempt (cancelled it, or failed it
// for its timeout) and freed its slot, so this outcome is always refused as
// stale_execution. It is sent anyway, so the log shows how the execution ended.
async function reportAborted(conn, rec, label) {
  const ids = { execution_id: rec.event.execution_id, reservation_id: rec.event.reservation_id };
  try {
    const reply = await report(conn, 'failed', {
      ...ids, error: { message: `aborted: ${rec.cancelled}`, type: 'Aborted' },
    }, label);
    warn(`aborted ${label}: belay took the failure report (state ${reply.state})`);
  } catch (err) {
    if (!(err instanceof ServerError && err.code === 'stale_execution') &&
        !(err instanceof ConnectionClosed)) {
      warn(`aborted ${label}: reporting it failed: ${err.message}`);
    }
  }
}

// One execution: started -> the handler -> succeeded or failed.
async function run(conn, rec) {
  const { event } = rec;
  const label = `job ${event.job_id} task ${event.task} attempt ${event.attempt}`;
  const ids = { execution_id: event.execution_id, reservation_id: event.reservation_id };
  const { signal } = rec.controller;
  if (!signal.aborted) {
    try {
      await conn.request('started', ids);
    } catch (err) {
      if (err instanceof ConnectionClosed) return;
      if (err instanceof ServerError && err.code === 'stale_execution') {
        // Ended before it started (a cancel, a timeout): nothing to run, nothing to report.
        log(`skipped ${label}: ${err.message}`);
        return;
      }
      warn(`started ${label}: ${err.message}; running it anyway`); // `started` only informs
    }
  }
  let fields;
  try {
    if (signal.aborted) throw signal.reason;
    log(`started ${label}`);
    const handler = TASKS[event.task];
    if (!handler) throw new Error(`this executor has no handler for task ${event.task}`);
    const work = Promise.resolve().then(() => handler(event.args ?? {}, event, signal));
    const result = await untilAborted(work, signal);
    fields = { ...ids, result: result === undefined ? null : result };
    // Too large for a frame (or not JSON: a BigInt, a cycle)? Then it fails the attempt.
    encode({ version: VERSION, type: 'succeeded', request_id: 'x'.repeat(MAX_REQUEST_ID_BYTES),
             ...fields });
    log(`ran ${label} -> ok`);
  } catch (err) {
    if (rec.cancelled) {
      log(`aborted ${label} (${rec.cancelled})`);
      await reportAborted(conn, rec, label);
      return;
    }
    if (signal.aborted) {
      // Shutdown or a lost connection: no report, so no attempt is used; the worker gives
      // the job back to its queue when this connection closes.
      log(`abandoned ${label} (${signal.reason && signal.reason.message})`);
      return;
    }
    const error = errorObject(err instanceof ProtocolError
      ? new RangeError(`the result does not fit in a frame (${err.message})`) : err);
    fields = { ...ids, error };
    log(`ran ${label} -> failed: ${error.type}: ${error.message}`);
  }
  const type = 'result' in fields ? 'succeeded' : 'failed';
  try {
    await report(conn, type, fields, label);
  } catch (err) {
    if (err instanceof ConnectionClosed) {
      warn(`${type} ${label}: the connection closed first; the worker gives the job back`);
    } else {
      warn(`${type} ${label}: ${err.message}`); // stale: it was reclaimed or timed out
    }
  }
}

// Start queued executions while fewer than max_concurrency run. belay sends at most that
// many per connection; the queue only keeps this process honest if it ever sent more.
function pump(conn) {
  while (!stopping && !conn.closed && conn.queued.length &&
         conn.running.size < options.maxConcurrency) {
    const rec = conn.queued.shift();
    conn.running.add(rec);
    rec.done = run(conn, rec)
      .catch((err) => warn(`job ${rec.event.job_id}: ${err.stack || err}`))
      .finally(() => {
        conn.running.delete(rec);
        conn.executions.delete(rec.event.execution_id);
        pump(conn);
      });
  }
}

function onMessage(conn, message) {
  if (message.type === 'execute') {
    const { execution_id: executionId, reservation_id: reservationId, task } = message;
    if (typeof executionId !== 'string' || typeof reservationId !== 'string' ||
        typeof task !== 'string') {
      warn(`an execute without execution_id, reservation_id or task: ${JSON.stringify(message)}`);
      return;
    }
    const rec = { event: message, controller: new AbortController(), cancelled: null, done: null };
    conn.executions.set(executionId, rec);
    // While stopping, it is not started: it goes back to its queue when we close.
    if (!stopping) {
      conn.queued.push(rec);
      pump(conn);
    }
  } else if (message.type === 'cancel_execution') {
    const rec = conn.executions.get(message.execution_id);
    if (!rec) return; // it already finished: nothing to stop
    rec.cancelled = message.reason || 'cancelled';
    rec.controller.abort(new Error(`cancel_execution: ${rec.cancelled}`));
    const waiting = conn.queued.indexOf(rec);
    if (waiting >= 0) { // never started: report it, to free belay's slot
      conn.queued.splice(waiting, 1);
      conn.executions.delete(message.execution_id);
      const label = `job ${rec.event.job_id} task ${rec.event.task} attempt ${rec.event.attempt}`;
      log(`aborted ${label} (${rec.cancelled})`);
      reportAborted(conn, rec, label);
    }
  } else if (message.type === 'error') {
    warn(`the worker reported an error: ${JSON.stringify(message.error)}`);
  } else {
    warn(`ignored a ${message.type} message (request_id ${message.request_id})`);
  }
}

// -- The executor ------------------------------------------------------------------------------

// Retry delays after a failed connect or a lost connection: 0.5 s doubling to 10 s.
class Backoff {
  constructor() { this.ms = 500; }
  reset() { this.ms = 500; }
  async wait(why) {
    warn(`${why}; retrying in ${this.ms} ms`);
    try {
      await sleep(this.ms, undefined, { signal: stopController.signal });
    } catch { /* SIGTERM */ }
    this.ms = Math.min(this.ms * 2, 10000);
  }
}

// hello -> hello_ok, register_tasks -> ok. A refused hello is a configuration mistake.
async function handshake(conn) {
  let hello;
  try {
    hello = await conn.request('hello', {
      mode: 'worker', runtime_id: process.env.BELAY_RUNTIME_ID || `node-${process.pid}`,
      max_concurrency: options.maxConcurrency,
    });
  } catch (err) {
    if (err instanceof ServerError) {
      warn(`the worker refused this executor: ${err.message}`);
      process.exit(2);
    }
    throw err;
  }
  conn.nodeId = hello.node_id;
  log(`connected to ${options.path} as ${conn.nodeId} (max_concurrency ${options.maxConcurrency})`);
  const ok = await conn.request('register_tasks', { tasks: Object.keys(TASKS) });
  log(`registered tasks ${ok.tasks.join(',')}`);
}

async function serve() {
  const backoff = new Backoff();
  while (!stopping) {
    let socket;
    try {
      socket = await connect(options.path);
    } catch (err) {
      await backoff.wait(`cannot connect to ${options.path} (${err.code || err.message})`);
      continue;
    }
    const conn = new Connection(socket, onMessage);
    try {
      await handshake(conn);
      current = conn;
      backoff.reset();
    } catch (err) {
      if (!(err instanceof ConnectionClosed)) warn(`handshake failed: ${err.message}`);
      socket.destroy();
    }
    await conn.done;
    current = null;
    // Whatever still runs was given back by the worker when the connection closed.
    for (const rec of conn.executions.values()) rec.controller.abort(new Error('disconnected'));
    if (!stopping) await backoff.wait(`the connection to ${options.path} closed`);
  }
}

// SIGTERM/SIGINT: take no more jobs (unregister_tasks), let the running ones finish for
// up to BELAY_SHUTDOWN_GRACE_MS and report them, then close: executions still running are
// aborted unreported, and belay gives their jobs back without using an attempt.
// A second signal exits at once.
async function shutdown(name) {
  if (stopping) {
    warn(`${name} again: exiting now; the worker gives unfinished jobs back`);
    process.exit(1);
  }
  stopping = true;
  stopController.abort();
  const conn = current;
  if (conn && !conn.closed) {
    log(`${name}: no more jobs; finishing ${conn.running.size} running`);
    conn.request('unregister_tasks', { tasks: Object.keys(TASKS) }).catch(() => {});
    const running = () => Promise.allSettled([...conn.running].map((rec) => rec.done));
    const grace = Number(process.env.BELAY_SHUTDOWN_GRACE_MS || 10000);
    const finished = await Promise.race([running().then(() => true), sleep(grace, false)]);
    if (!finished) {
      for (const rec of conn.running) rec.controller.abort(new Error('shutting down'));
      await Promise.race([running(), sleep(2000)]); // reports already sent get their answer
    }
    conn.socket.end();
    await Promise.race([conn.done, sleep(2000)]);
  }
  log('stopped');
  process.exit(0);
}

function main() {
  options = parseArgs(process.argv.slice(2));
  process.on('SIGTERM', () => shutdown('SIGTERM'));
  process.on('SIGINT', () => shutdown('SIGINT'));
  serve().catch((err) => {
    warn(`the executor failed: ${err.stack || err}`);
    process.exit(1);
  });
}

module.exports = { FrameReader, ProtocolError, encode, decode, MAX_FRAME_BYTES, TASKS };

if (require.main === module) main();
