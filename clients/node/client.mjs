#!/usr/bin/env node
// Node.js client for `minedraft serve` (protocol v1, docs/PROTOCOL.md): a zeromq Dealer socket, one msgpack
// map per frame (no empty delimiter frame), replies routed by request id.
//
// As a library:
//   import { MinedraftClient } from "./client.mjs";
//   const c = new MinedraftClient("tcp://127.0.0.1:5555");
//   const r = await c.generate("Hello", { max_tokens: 16 });
//   for await (const d of c.stream("Hello", { max_tokens: 16 })) process.stdout.write(d.text ?? "");
//   c.close();
//
// As a command (prints JSON to stdout; errors as {"error": {code, message}} with exit code 1):
//   node client.mjs --endpoint tcp://127.0.0.1:5555 generate "Hello" --max-tokens 16
//   node client.mjs stream "Hello" --max-tokens 16          (one JSON line per message, then a summary line)
//   node client.mjs cancel-demo "Hello" --max-tokens 200 --after 1
//   node client.mjs health | stats

import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { pathToFileURL } from "node:url";

import { decode, encode } from "@msgpack/msgpack";
import * as zmq from "zeromq";

export const VERSION = 1;

export class MinedraftError extends Error {
  constructor(code, message, reply = null) {
    super(message);
    this.name = "MinedraftError";
    this.code = code;
    this.reply = reply;
  }
}

export class TimeoutError extends MinedraftError {
  constructor(message) {
    super("timeout", message);
    this.name = "TimeoutError";
  }
}

/** A z85 key given inline (40 chars) or as a file holding one. */
export function readKey(keyOrPath) {
  if (keyOrPath == null) return null;
  const s = String(keyOrPath).trim();
  if (s.length === 40 && /^[0-9a-zA-Z.\-:+=^!/*?&<>()[\]{}@%$#]+$/.test(s)) return s;
  const text = readFileSync(s, "utf8").trim();
  const m = text.match(/[0-9a-zA-Z.\-:+=^!/*?&<>()[\]{}@%$#]{40}/);
  if (!m) throw new Error(`${s}: no z85 CURVE key found`);
  return m[0];
}

class AsyncQueue {
  constructor() {
    this.items = [];
    this.waiters = [];
  }
  push(x) {
    const w = this.waiters.shift();
    if (w) w(x);
    else this.items.push(x);
  }
  pop(timeoutMs) {
    if (this.items.length) return Promise.resolve(this.items.shift());
    return new Promise((resolve, reject) => {
      let timer = null;
      const waiter = (x) => {
        if (timer) clearTimeout(timer);
        resolve(x);
      };
      this.waiters.push(waiter);
      if (timeoutMs != null) {
        timer = setTimeout(() => {
          const i = this.waiters.indexOf(waiter);
          if (i >= 0) this.waiters.splice(i, 1);
          reject(new TimeoutError(`no reply within ${timeoutMs} ms`));
        }, timeoutMs);
      }
    });
  }
}

/** `promise`, or a TimeoutError after `ms` (null: no limit); the timer never outlives the race. */
function withDeadline(promise, ms, message) {
  if (ms == null) return promise;
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new TimeoutError(message)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

export class MinedraftClient {
  /**
   * @param {string} endpoint e.g. "tcp://127.0.0.1:5555"
   * @param {{serverPublicKey?: string, timeoutMs?: number}} opts serverPublicKey turns CURVE on (z85 or file)
   */
  constructor(endpoint = "tcp://127.0.0.1:5555", opts = {}) {
    this.endpoint = endpoint;
    this.timeoutMs = opts.timeoutMs ?? null;
    const options = { linger: 0, receiveHighWaterMark: 0 };
    if (opts.serverPublicKey) {
      const { publicKey, secretKey } = zmq.curveKeyPair();
      Object.assign(options, {
        curveServerKey: readKey(opts.serverPublicKey),
        curvePublicKey: publicKey,
        curveSecretKey: secretKey,
      });
    }
    this.sock = new zmq.Dealer(options);
    if (endpoint.startsWith("tcp://[")) this.sock.ipv6 = true;
    this.sock.connect(endpoint);
    this.requests = new Map(); // id -> AsyncQueue | null (null: abandoned, waiting for its final message)
    this.control = new Map(); // "kind:id" -> {resolve, reject}
    this.nextId = 1;
    this.sendChain = Promise.resolve();
    this.closed = false;
    this.reader = this.#readLoop();
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    this.sock.close();
    const err = new MinedraftError("closed", "client closed");
    for (const q of this.requests.values()) if (q) q.push(err);
    for (const c of this.control.values()) c.reject(err);
    this.control.clear();
  }

  // zeromq.js allows one send in flight per socket: chain them.
  #send(msg) {
    const data = encode({ v: VERSION, ...msg });
    const p = this.sendChain.then(() => this.sock.send(data));
    this.sendChain = p.catch(() => {});
    return p;
  }

  async #readLoop() {
    try {
      for await (const frames of this.sock) {
        let msg;
        try {
          msg = decode(frames[frames.length - 1]);
        } catch {
          continue;
        }
        if (msg && typeof msg === "object") this.#dispatch(msg);
      }
    } catch (e) {
      if (!this.closed) {
        const err = new MinedraftError("connection", `connection failed: ${e.message}`);
        for (const q of this.requests.values()) if (q) q.push(err);
      }
    }
  }

  #toRequest(id, msg, final) {
    if (!this.requests.has(id)) return;
    const q = this.requests.get(id);
    if (q) q.push(msg);
    else if (final) this.requests.delete(id);
  }

  #resolve(key, msg) {
    const c = this.control.get(key);
    if (c) {
      this.control.delete(key);
      c.resolve(msg);
    }
  }

  #dispatch(msg) {
    const { t, id } = msg;
    if (t === "result" || t === "delta" || t === "done") this.#toRequest(id, msg, t !== "delta");
    else if (t === "cancelled") this.#resolve(`cancel:${id}`, msg);
    else if (t === "health" || t === "stats") this.#resolve(`${t}:${id}`, msg);
    else if (t === "error") {
      if (["cancel", "health", "stats"].includes(msg.re)) this.#resolve(`${msg.re}:${id}`, msg);
      else if (this.requests.has(id) && msg.code !== "duplicate_id") this.#toRequest(id, msg, true);
      else for (const k of ["cancel", "health", "stats"]) if (this.control.has(`${k}:${id}`)) return this.#resolve(`${k}:${id}`, msg);
    }
  }

  static #check(msg) {
    if (msg instanceof Error) throw msg;
    if (msg.t === "error") throw new MinedraftError(msg.code, msg.message, msg);
    return msg;
  }

  #register(id) {
    if (this.closed) throw new MinedraftError("closed", "client closed");
    const rid = id ?? `r${this.nextId++}`;
    if (this.requests.has(rid)) throw new MinedraftError("duplicate_id", `request id ${rid} is already in flight`);
    const q = new AsyncQueue();
    this.requests.set(rid, q);
    return [rid, q];
  }

  #release(rid, finished) {
    if (finished || this.closed) {
      this.requests.delete(rid);
      return;
    }
    this.requests.set(rid, null); // keep the id until the server's final message for it
    this.#send({ t: "cancel", id: rid }).catch(() => this.requests.delete(rid));
  }

  /** Run one request to completion: {id, text, token_ids, finish_reason, stats}. */
  async generate(prompt, params = {}, { id, timeoutMs } = {}) {
    const [rid, q] = this.#register(id);
    let finished = false;
    try {
      const t = timeoutMs ?? this.timeoutMs;
      await withDeadline(this.#send({ t: "generate", id: rid, prompt, params }), t, `request not sent within ${t} ms`);
      const msg = await q.pop(t);
      finished = true;
      const { text, token_ids, finish_reason, stats } = MinedraftClient.#check(msg);
      return { id: rid, text, token_ids, finish_reason, stats };
    } finally {
      this.#release(rid, finished);
    }
  }

  /** Yields {type: "delta", text, token_ids} per delta, then {type: "done", finish_reason, stats}. */
  async *stream(prompt, params = {}, { id, timeoutMs } = {}) {
    const [rid, q] = this.#register(id);
    let finished = false;
    try {
      const t = timeoutMs ?? this.timeoutMs;
      await withDeadline(this.#send({ t: "stream", id: rid, prompt, params }), t, `request not sent within ${t} ms`);
      for (;;) {
        let msg = await q.pop(t);
        if (!(msg instanceof Error) && msg.t === "error") finished = true;
        msg = MinedraftClient.#check(msg);
        if (msg.t === "done") {
          finished = true;
          yield { id: rid, type: "done", finish_reason: msg.finish_reason, stats: msg.stats };
          return;
        }
        yield { id: rid, type: "delta", text: msg.text, token_ids: msg.token_ids };
      }
    } finally {
      this.#release(rid, finished);
    }
  }

  async #controlCall(kind, id, timeoutMs) {
    const key = `${kind}:${id}`;
    if (this.control.has(key)) throw new MinedraftError("duplicate_id", `a ${kind} for ${id} is already pending`);
    const reply = new Promise((resolve, reject) => this.control.set(key, { resolve, reject }));
    const t = timeoutMs ?? this.timeoutMs;
    try {
      // The deadline covers the send too: before a CURVE handshake completes the send itself may wait.
      const sentThenReply = this.#send({ t: kind, id }).then(() => reply);
      return MinedraftClient.#check(await withDeadline(sentThenReply, t, `no ${kind} reply within ${t} ms`));
    } finally {
      this.control.delete(key);
    }
  }

  /** Resolves once the server has ended the request (its final message has then arrived). */
  async cancel(id, { timeoutMs } = {}) {
    await this.#controlCall("cancel", id, timeoutMs);
  }

  async health({ timeoutMs } = {}) {
    return (await this.#controlCall("health", `h${this.nextId++}`, timeoutMs)).health;
  }

  async stats({ timeoutMs } = {}) {
    return (await this.#controlCall("stats", `s${this.nextId++}`, timeoutMs)).stats;
  }
}

// -- command line ---------------------------------------------------------------------------------------------
const USAGE = `usage: node client.mjs [--endpoint E] [--server-key KEY] [--timeout-ms N] COMMAND [ARGS]

commands:
  generate PROMPT     print the result as one JSON object
  stream PROMPT       print one JSON line per delta, then the done message, then a summary line
                      {"type": "summary", text, token_ids, finish_reason, stats}
  cancel-demo PROMPT  stream, cancel after --after N deltas (0: at once), print what arrived as JSON
  health | stats      print the server's health / stats

options:
  --endpoint E        server endpoint (default tcp://127.0.0.1:5555)
  --server-key KEY    server CURVE public key (z85 or a file): turns encryption on
  --timeout-ms N      give up waiting for a reply after N ms (default: wait forever)
  --max-tokens N --temperature T --top-k K --top-p P --seed N --stop TEXT (repeatable) --ignore-eos
  --token-ids         PROMPT is a JSON array of token ids, e.g. "[1, 2, 3]"
  --id ID             request id (default: generated)
  --after N           cancel-demo: deltas to wait for before cancelling (default 1)`;

function buildParams(v) {
  const p = {};
  if (v["max-tokens"] !== undefined) p.max_tokens = parseInt(v["max-tokens"], 10);
  if (v.temperature !== undefined) p.temperature = parseFloat(v.temperature);
  if (v["top-k"] !== undefined) p.top_k = parseInt(v["top-k"], 10);
  if (v["top-p"] !== undefined) p.top_p = parseFloat(v["top-p"]);
  if (v.seed !== undefined) p.seed = parseInt(v.seed, 10);
  if (v.stop && v.stop.length) p.stop = v.stop;
  if (v["ignore-eos"]) p.ignore_eos = true;
  return p;
}

async function runCli(argv) {
  const { values: v, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      endpoint: { type: "string", default: "tcp://127.0.0.1:5555" },
      "server-key": { type: "string" },
      "timeout-ms": { type: "string" },
      "max-tokens": { type: "string" },
      temperature: { type: "string" },
      "top-k": { type: "string" },
      "top-p": { type: "string" },
      seed: { type: "string" },
      stop: { type: "string", multiple: true },
      "ignore-eos": { type: "boolean" },
      "token-ids": { type: "boolean" },
      id: { type: "string" },
      after: { type: "string", default: "1" },
      help: { type: "boolean", short: "h" },
    },
  });
  const [command, promptArg] = positionals;
  if (v.help || !command) {
    console.log(USAGE);
    return v.help ? 0 : 2;
  }
  const out = (x) => process.stdout.write(JSON.stringify(x) + "\n");
  const client = new MinedraftClient(v.endpoint, {
    serverPublicKey: v["server-key"],
    timeoutMs: v["timeout-ms"] !== undefined ? parseInt(v["timeout-ms"], 10) : null,
  });
  try {
    const needPrompt = ["generate", "stream", "cancel-demo"].includes(command);
    if (needPrompt && promptArg === undefined) throw new MinedraftError("usage", `${command} needs a PROMPT`);
    const prompt = v["token-ids"] && needPrompt ? JSON.parse(promptArg) : promptArg;
    const params = buildParams(v);
    if (command === "generate") {
      out(await client.generate(prompt, params, { id: v.id }));
    } else if (command === "stream") {
      let text = "";
      const tokenIds = [];
      for await (const d of client.stream(prompt, params, { id: v.id })) {
        out(d);
        if (d.type === "delta") {
          text += d.text;
          tokenIds.push(...d.token_ids);
        } else {
          out({ type: "summary", id: d.id, text, token_ids: tokenIds, finish_reason: d.finish_reason, stats: d.stats });
        }
      }
    } else if (command === "cancel-demo") {
      const after = parseInt(v.after, 10);
      const id = v.id ?? "cancel-demo-1";
      let text = "";
      const tokenIds = [];
      let deltas = 0;
      let finish = null;
      let stats = null;
      let cancelPromise = null;
      let pending = null;
      const doCancel = () => client.cancel(id).then(() => true);
      const it = client.stream(prompt, params, { id });
      if (after === 0) {
        // The stream's request is sent on the first next(); queue the cancel right behind it.
        const first = it.next();
        cancelPromise = doCancel();
        pending = first;
      }
      for (;;) {
        const { value: d, done } = await (pending ?? it.next());
        pending = null;
        if (done) break;
        if (d.type === "delta") {
          deltas += 1;
          text += d.text;
          tokenIds.push(...d.token_ids);
          if (cancelPromise === null && deltas >= after) cancelPromise = doCancel();
        } else {
          finish = d.finish_reason;
          stats = d.stats;
        }
      }
      const acked = cancelPromise ? await cancelPromise : false;
      out({ id, deltas, text, token_ids: tokenIds, finish_reason: finish, cancelled: acked, stats });
    } else if (command === "health") {
      out(await client.health());
    } else if (command === "stats") {
      out(await client.stats());
    } else {
      throw new MinedraftError("usage", `unknown command ${command}\n${USAGE}`);
    }
    return 0;
  } catch (e) {
    out({ error: { code: e.code ?? "client", message: e.message } });
    return 1;
  } finally {
    client.close();
  }
}

if (import.meta.url === pathToFileURL(process.argv[1]).href) {
  runCli(process.argv.slice(2)).then(
    (code) => process.exit(code),
    (e) => {
      console.error(e);
      process.exit(1);
    },
  );
}
