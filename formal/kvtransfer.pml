/*
 * kvtransfer.pml -- the kvguard KV transfer and abort protocol, a Promela model for SPIN.
 *
 * One router, one prefill worker, one decode worker, NREQ concurrent requests; a decode pool of NDP
 * pages with generation tags (workers/kv_pool.py) and a prefill pool of NPP pages; each worker's
 * scheduler runs at most DRUN / PRUN requests holding pages (running slots). The router starts
 * both legs at once: prefill computes while decode allocates and bootstraps; the router turns the
 * bootstrap into a transfer ticket and delivers it to prefill (POST /internal/ticket), which sends
 * nothing and connects nowhere before it holds one; prefill connects
 * (HELLO/WELCOME: decode's boot epoch), OPENs the transfer with the ticket, sends one CHUNK per page
 * under a byte credit (S6) and a MANIFEST, which carries the request's first token (wire v4,
 * workers/transfer/wire.py: a first-token record under the MANIFEST's checksum); decode answers ACK
 * (credit) and RESULT, and the first token it streams to the router is the MANIFEST's. Aborts from
 * every side at every step, timeouts, a router that hangs, connection resets, worker restarts, chunk loss, corruption of
 * a CHUNK or of the MANIFEST, and an adversary replaying captured frames and forging foreign ones.
 * formal/README.md has the bounds, the abstractions and what is (and is not) proven.
 *
 * Each worker is an asyncio event loop: an atomic block is the code between two awaits.
 * Names are the code's: RequestState (request_state), TransferState (transfer_state, prefixed T_
 * since OPEN is also a frame), FrameType (frame), FailureReason (failure_reason, in trail logs).
 * tests/test_formal_model.py fails if they drift from the Python enums.
 *
 * Layers: the core (pool, leases, chunked transfer with credit, manifest, intake, aborts, faults);
 * on top, the ticket layer of issue #11 (OPEN with a router-MAC'd ticket, frames MAC'd with a key
 * bound to the ticket nonce and the connection, boot epochs) -- the BOUND, TICKET_ISSUED and EPOCH_CHECK
 * checks below.
 *
 * Invariants are assertions on globals named after them (SPIN reports "assertion violated S1"):
 *   S1 S2 S3 S5 S6 NOREPLAY OUTCOME during the run, S4 in the quiescence monitor, plus SPIN's own check that
 *   no process ends stuck outside an end state. S3 is asserted where decode verifies and again where
 *   the client sees it: the router's receipt of the first token (a ghost flag per request, dverified).
 */

/* ------------------------------------------------------------------------------ configuration */

#ifndef NREQ
#define NREQ 2
#endif
#define MAXNEED 2                        /* pages of KV per request, at most */
#define NEED(r) (((r) == 0) -> 2 : 1)    /* request 0 needs 2 pages (2 chunks), the others 1 */
#ifndef NDP
#define NDP 2                            /* decode pool: small, so freed pages are reused at once */
#endif
#ifndef NPP
#define NPP 2                            /* prefill pool */
#endif
#ifndef CAP
#define CAP 1                            /* S6: max_transfer_batch, in chunks (1 chunk = 1 page) */
#endif
/* Running slots: the engine's scheduler admits at most max_running_requests requests holding pages
 * (workers/scheduler.py `max_running`); a prefill request holds its slot from its pages to their
 * release (computed, waiting for its ticket, sending), a decode request from its allocation at
 * bootstrap to its end. By default one more slot than requests: never a bound (the state counts of
 * the runs without it are those of the model before it). model_slots sets PRUN=2 DRUN=1. */
#ifndef PRUN
#define PRUN (NREQ + 1)                  /* prefill's max_running_requests */
#endif
#ifndef DRUN
#define DRUN (NREQ + 1)                  /* decode's max_running_requests */
#endif
#define NSLOT 3                          /* TCP connections over a run: 0, 1 prefill's, 2 the adversary's */
#define PSLOTS 2
#define ASLOT 2
#define QLEN 8                           /* frames prefill->decode one connection can hold */
#define DQLEN 4                          /* frames decode->prefill (WELCOME, RESULTs; ACKs are counted) */
#define NNONCE (2 * NREQ + 1)            /* tickets: at most one per request per decode boot */

/* Bounds. A run's fault budgets say how many times each event may happen (0: never):
 *   disc     the router ends a request at any moment: the client went away (or request_timeout_s
 *            ran out early)
 *   perr     prefill fails computing, or its chunk source raises
 *   derr     decode's engine fails: a forward pass fails a request while it decodes (the engine
 *            isolates it), or a step fails outside the forward pass (AsyncEngine._step), which
 *            aborts a live request in any state -- waiting for pages, PREALLOCATED or RECEIVING:
 *            its pages are freed while its transfer may still be writing into them
 *   reset    prefill's connection to decode is reset (RST)
 *   drop     prefill drops a chunk (the drop_chunk fault: a silent loss)
 *   corrupt  a payload is corrupted in flight: a CHUNK's KV, or the MANIFEST's first-token record
 *   drest    the decode worker restarts: new boot epoch, empty pool, every connection reset
 *   prest    the prefill worker restarts
 *   replay   adversary actions: connect to decode's port, inject a replayed or forged frame
 *   expire   a ticket has expired when prefill or decode checks it
 *   tmo      a timer fires spuriously (a slow peer looks exactly like a dead one)
 * Time: besides spurious firings, a timer fires when nothing else can happen any more (SPIN's
 * `timeout`: time passes until an armed timer runs out). A `prompt` row allows neither -- timers
 * fire only after a silent fault (a dropped chunk) -- so aborts, errors, connection losses and
 * restarts must end both halves by message alone.
 *
 * Each BOUNDS_ROW line below is one configuration. init picks one nondeterministically, so ONE pan run
 * explores every interleaving of every placement of the faults of every row (the state counts
 * add up); -DROW=n checks row n alone. formal/README.md lists the rows; formal/check.py runs them. */
#ifndef ROW
#define ROW 0
#endif
#ifndef OVERLEN
#define OVERLEN 1                        /* the last request may be over-length (S2) */
#endif
#define BOUNDS_ROW(n, pr, disc, perr, derr, reset, drop, corrupt, drest, prest, replay, expire, tmo) \
  :: ROW == 0 || ROW == n -> \
     prompt = pr; b_disc = disc; b_perr = perr; b_derr = derr; b_reset = reset; b_drop = drop; \
     b_corrupt = corrupt; b_drestart = drest; b_prestart = prest; b_replay = replay; \
     b_expire = expire; b_tmo = tmo; printf("MSC: bounds row %d\n", n)
/*            row prompt disc  perr  derr reset  drop corrupt drest prest replay expire tmo
 * Row 11 is row 1 behind a router whose intake check is off (a router of another revision, or a
 * misconfigured one): over-length requests reach both workers, whose own checks must hold S2.
 * Row 12's engine error may come in any state (derr_any), not only while decoding. Its own row: an
 * unspent fault that is enabled in a waiting state keeps the model from quiescence, so it would
 * hide a deadlock of the waiting states (the unbounded_early mutant's, row 3) until it fires.
 * Row 13 is row 1 with no timers: any wait that nothing ends is a deadlock (S4). model_slots runs it
 * with 3 requests and few running slots (PRUN, DRUN), the early_takes_every_slot mutant too.
 * Row 14 is a disconnect whose abort call to one worker is lost (b_lose): with no timers, the worker
 * must end the request because the router closed its call (D_GONE, P_GONE), not by the abort.
 * Rows 15, 9 and 10: the router may hang (b_rhang: R_HUNG) -- partitioned from the workers, or its
 * process stuck: from then on nothing of it reaches them, no abort, no close of its calls (so no
 * D_GONE, P_GONE), no request timer. Only the workers' own timers can end both halves: decode's
 * open and stall timers, prefill's bootstrap timer (NO_D_TIMER, NO_P_TIMER: each then fails S4).
 * Row 15 is row 1 with the hang; rows 9 and 10 add it to their faults. */
#define BOUNDS \
  BOUNDS_ROW( 1,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0); \
  BOUNDS_ROW( 2,    1,    1,    1,    0,    0,    1,    0,    0,    0,    0,    0,    0); \
  BOUNDS_ROW( 3,    1,    0,    0,    1,    1,    0,    0,    0,    0,    0,    0,    0); \
  BOUNDS_ROW( 4,    1,    0,    0,    0,    0,    0,    0,    1,    0,    0,    0,    0); \
  BOUNDS_ROW( 5,    1,    0,    1,    0,    0,    0,    0,    0,    1,    0,    0,    0); \
  BOUNDS_ROW( 6,    1,    2,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0); \
  BOUNDS_ROW( 7,    1,    1,    0,    0,    1,    0,    0,    0,    0,    0,    0,    0); \
  BOUNDS_ROW( 8,    0,    0,    0,    0,    0,    0,    0,    0,    0,    2,    0,    0); \
  BOUNDS_ROW( 9,    0,    0,    0,    0,    0,    0,    1,    0,    0,    0,    1,    0); b_rhang = 1; \
  BOUNDS_ROW(10,    0,    0,    0,    0,    0,    1,    0,    0,    0,    0,    0,    1); b_rhang = 1; \
  BOUNDS_ROW(11,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0); router_intake = false; \
  BOUNDS_ROW(12,    1,    0,    0,    1,    0,    0,    0,    0,    0,    0,    0,    0); derr_any = true; \
  BOUNDS_ROW(13,    1,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0); \
  BOUNDS_ROW(14,    1,    1,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0); b_lose = 1; \
  BOUNDS_ROW(15,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0,    0); b_rhang = 1

#define TIMERS_OK (!prompt || silent_fault)
#define TIMER (b_tmo > 0 || (timeout && TIMERS_OK))
#define QUIET_TIMER (timeout && TIMERS_OK)

/* The adversary: by default it can reach decode's transfer port (a pod outside the revision, or a
 * replay from anywhere) and holds one frame captured from prefill's traffic. ONPATH: it can also
 * append frames to prefill's live connection (an on-path attacker who can inject into the stream). */
#ifdef ONPATH
#define ON_PATH 1
#else
#define ON_PATH 0
#endif
/* Frame numbers (wire v3, workers/transfer/channel.py FrameReader/FrameWriter): every frame's MAC
 * covers its place on its connection (counted by both ends, not sent), so decode closes a
 * connection on a frame that is not the next one: a copy, even on prefill's own connection, fails
 * verification. MUTANT_NO_CONN_SEQ is wire v2, where a copied-back frame verified again: with
 * ONPATH it earns credit for bytes still in flight (S6; formal/README.md). */
#ifdef MUTANT_NO_CONN_SEQ
#define CONN_SEQ 0
#else
#define CONN_SEQ 1
#endif

/* The router watches the prefill leg while it waits for decode's events (Router._next_event): a
 * prefill that failed, or died, before its OPEN reached decode ends both legs at once. Without it
 * (-DWATCH_PREFILL=0, the code before the model found this) decode holds the pages until its stall
 * timer fires: S4 holds only through the timer, and the `prompt` rows fail. */
#ifndef WATCH_PREFILL
#define WATCH_PREFILL 1
#endif

/* D_GONE (below): decode ends a request whose router closed the call. -DNO_D_GONE: the handler
 * waits on (aiohttp without handler_cancellation), and row 14 leaves decode's pages held. */
#ifdef NO_D_GONE
#define D_GONE_WATCH 0
#else
#define D_GONE_WATCH 1
#endif

/* The workers' own timers (S4 when the router hangs: R_HUNG, rows 9, 10 and 15). Each switch turns
 * one off; each is a mutant whose counterexample needs the router's hang (formal/README.md).
 * NO_D_TIMER: decode's transfer timers, the open timer (EXPECTED: open_timeout_s) and the stall
 * timer (OPEN: stall_timeout_s) -- KVReceiver._arm/_on_timer. NO_P_TIMER: prefill's bootstrap timer
 * (--bootstrap-timeout: PrefillServer._ticket_of's 504). NO_P_SEND_TIMERS: the sender's connect,
 * credit and RESULT timers (KVSender: connect_timeout_s, stall_timeout_s), which decode's RESULT
 * covers (a switch of the table of guards whose removal alone verifies). */
#ifdef NO_D_TIMER
#define D_TIMER 0
#else
#define D_TIMER 1
#endif
#ifdef NO_P_TIMER
#define P_TIMER 0
#else
#define P_TIMER 1
#endif
#ifdef NO_P_SEND_TIMERS
#define P_SEND_TIMER 0
#else
#define P_SEND_TIMER 1
#endif

/* Mutants: each re-creates a real bug class (../shared/reference/pd-bug-classes.md); each must fail. */
#ifdef MUTANT_INCIDENT                   /* A: rejected request still transferred (sglang#30233) */
#define UNSAFE_REJECT_PATH 1
#else
#define UNSAFE_REJECT_PATH 0
#endif
#ifdef MUTANT_NO_ABORT_PROPAGATION       /* B: an abort never reaches decode (sglang#28651) */
#define PROPAGATE 0
#else
#define PROPAGATE 1
#endif
#if defined(MUTANT_FREE_IN_FLIGHT) || defined(ONLY_FREE_BEFORE_CANCEL)
#define FREE_BEFORE_CANCEL 1             /* E: decode frees the pages before it ends the transfer */
#else
#define FREE_BEFORE_CANCEL 0
#endif
#if defined(MUTANT_FREE_IN_FLIGHT) || defined(ONLY_NO_GEN_CHECK)
#define GEN_CHECK 0                      /* E: the pool applies a write without the generation check */
#else
#define GEN_CHECK 1
#endif
/* C/D: "done" taken without checking the manifest or the written pages (vllm#50754, sglang#23797);
 * ONLY_NO_MANIFEST_CHECK / ONLY_NO_VERIFY_WRITTEN remove one of the two alone (each verifies: the
 * other covers it, formal/README.md) */
#if defined(MUTANT_DONE_WITHOUT_MANIFEST) || defined(ONLY_NO_MANIFEST_CHECK)
#define CHECK_MANIFEST 0
#else
#define CHECK_MANIFEST 1
#endif
#if defined(MUTANT_DONE_WITHOUT_MANIFEST) || defined(ONLY_NO_VERIFY_WRITTEN)
#define VERIFY_WRITTEN 0
#else
#define VERIFY_WRITTEN 1
#endif
#ifdef MUTANT_NO_TICKET_BINDING          /* G/S9: frames accepted without their ticket nonce: MAC'd with the
                                            revision key, taken on any connection (the protocol before #11) */
#define BOUND 0
#else
#define BOUND 1
#endif
/* A seeded bug for S3 where the client sees it: decode emits the first token as soon as the
 * transfer completes, before start_decode's checks (lease_written, the request's state) -- a token
 * from KV that was never verified reaches the router even when those checks then refuse it. */
#ifdef MUTANT_TOKEN_FIRST
#define TOKEN_FIRST 1
#else
#define TOKEN_FIRST 0
#endif
/* The router takes decode's error event as its finish (awaits prefill, then ends cleanly): the
 * client hears a finished request that decode aborted (OUTCOME). */
#ifdef MUTANT_ERROR_AS_FINISH
#define ERROR_AS_FINISH 1
#else
#define ERROR_AS_FINISH 0
#endif
#ifdef MUTANT_NO_EPOCH                   /* neither side compares the ticket's boot epoch */
#define EPOCH_CHECK 0
#else
#define EPOCH_CHECK 1
#endif
/* Single guards, each removable alone (formal/README.md: which must fail, which another guard covers) */
#ifdef MUTANT_DECODE_ADMITS_OVERLEN      /* decode's intake (engine.check_fits) does not reject */
#define D_INTAKE 0
#else
#define D_INTAKE 1
#endif
#ifdef MUTANT_PREFILL_ADMITS_OVERLEN     /* prefill's intake does not reject */
#define P_INTAKE 0
#else
#define P_INTAKE 1
#endif
#ifdef NO_PLAN_CHECK                     /* PlanTracker.check_chunk: planned page and generation, order, once */
#define PLAN_CHECK 0
#else
#define PLAN_CHECK 1
#endif
#ifdef NO_OPEN_NONCE                     /* _refusal: the ticket's nonce is the transfer's */
#define OPEN_NONCE 0
#else
#define OPEN_NONCE 1
#endif
#ifdef NO_RESULT_NONCE                   /* prefill's reader: a RESULT's nonce is its ticket's */
#define RESULT_NONCE 0
#else
#define RESULT_NONCE 1
#endif
#ifdef NO_ACK_CLAMP                      /* prefill's reader: an ACK never returns more than was sent */
#define ACK_CLAMP 0
#else
#define ACK_CLAMP 1
#endif
#ifdef MUTANT_NO_MANIFEST_CHECKSUM     /* _on_manifest: the first-token record's checksum (wire v4, S3) */
#define MANIFEST_CHECKSUM 0
#else
#define MANIFEST_CHECKSUM 1
#endif
#ifdef NO_START_STATE_CHECK              /* engine.start_decode's _get: the request is still PREALLOCATED
                                            or RECEIVING (not aborted by the engine meanwhile) */
#define START_STATE_CHECK 0
#else
#define START_STATE_CHECK 1
#endif
#ifdef NO_S2_ASSERT                      /* lets the incident mutant run on to the leak it causes (S1) */
#define CHECK_S2 0
#else
#define CHECK_S2 1
#endif

/* ------------------------------------------------------------------------------ names */

/* kvguard.workers.request.RequestState */
mtype:request_state = { RECEIVED, ADMITTED, REJECTED, PREFILLING, TRANSFERRING, DONE,
                        PREALLOCATED, RECEIVING, VERIFIED, DECODING, FINISHED, ABORTED };
/* kvguard.workers.transfer TransferState (T_ prefix: OPEN is also a frame) */
mtype:transfer_state = { T_EXPECTED, T_CONNECTING, T_OPEN, T_SEALED, T_COMPLETE, T_FAILED };
/* kvguard.workers.transfer FrameType */
mtype:frame = { HELLO, WELCOME, OPEN, CHUNK, MANIFEST, ABORT, ACK, RESULT };
/* kvguard.workers.transfer FailureReason (the model logs them in trails; they are not state) */
mtype:failure_reason = { CHECKSUM, PLAN_MISMATCH, MANIFEST_MISMATCH, STALE, UNKNOWN_REQUEST, PEER_ABORT,
                         CANCELLED, TIMEOUT, CONNECTION_LOST, PROTOCOL_ERROR, TICKET };
/* the decode leg's event stream to the router (workers/protocol.py: BootstrapEvent, ...) */
mtype:decode_event = { EV_BOOTSTRAP, EV_TOKEN, EV_FINISH, EV_ERROR };
/* the router's view of one request (Router._generate has no enum) */
mtype:router_phase = { R_INTAKE, R_DECODE_LEG, R_STREAMING, R_WAIT_PREFILL, R_ENDED, R_HUNG };

/* HTTP control messages (router -> workers): 0 not sent, then */
#define MSG_SENT 1
#define MSG_TAKEN 2
#define MSG_LOST 3                       /* an abort that arrived before the request it names: a no-op */
#define MSG_WITHDRAWN 4                  /* the router cancelled the call before it reached the worker */
/* prefill's HTTP answer */
#define PRES_OK 1
#define PRES_ERR 2
/* decode's verdict as prefill's sender sees it (RESULT, or a lost connection) */
#define RES_OK 1
#define RES_FAIL 2
/* one TCP connection */
#define NET_NONE 0
#define NET_UP 1
#define NET_FIN 2                        /* decode closed it: prefill still reads what decode wrote */
#define NET_RST 3                        /* reset: both directions lost */
#define NET_GONE 4                       /* closed by prefill */
/* decode's end of a connection */
#define RC_IDLE 0
#define RC_UP 1
#define RC_CLOSED 2
/* prefill's connection pool (max_connections_per_peer = 1 in the model) */
#define PC_NONE 0
#define PC_HELLO 1
#define PC_UP 2

#define TAG(r, i) ((r) * MAXNEED + (i) + 1)  /* ghost: the KV bytes of request r's page i */
#define PLACEHOLDER 200                      /* the incident's one-token placeholder KV */
#define GARBAGE 201                          /* a corrupted payload */
#define BIT(r) (1 << (r))

/* ------------------------------------------------------------------------------ state */

/* invariants: each assertion prints its name */
bool S1 = true, S2 = true, S3 = true, S4 = true, S5 = true, S6 = true, NOREPLAY = true;
bool OUTCOME = true;                     /* a clean end at the router: decode FINISHED, prefill DONE */
bool QSIZE = true;                       /* a model bound: a channel never fills */

/* client and router */
bool over[NREQ];                         /* prompt + max_tokens exceed the context or a pool */
mtype:router_phase rphase[NREQ];
bool rgone[NREQ];                        /* the router closed this request's decode stream */
bool dbroken[NREQ];                      /* the decode stream broke (the decode worker died) */
byte dq[NREQ], pq[NREQ], tq[NREQ];       /* POST /internal/decode, /internal/prefill, /internal/ticket */
byte abort_d[NREQ], abort_p[NREQ];       /* POST /internal/abort to decode, to prefill */
byte pres[NREQ];                         /* prefill's HTTP answer */
chan dstream[NREQ] = [3] of { mtype:decode_event, byte };   /* event, bootstrap nonce */
byte tk[NREQ];                           /* the nonce of the ticket the router issued for r */

/* tickets by nonce (1..): unforgeable (the router's MAC), so a table of the issued ones is all */
byte tk_rid[NNONCE + 1], tk_epoch[NNONCE + 1];
byte tk_page[(NNONCE + 1) * MAXNEED], tk_gen[(NNONCE + 1) * MAXNEED];
byte nonces;

/* decode worker */
byte d_epoch = 1;
mtype:request_state ds[NREQ];
bool djob[NREQ];                         /* WorkerRuntime.jobs[rid], a DecodeJob */
bool dlease[NREQ];
byte lpage[NREQ * MAXNEED], lgen[NREQ * MAXNEED];      /* the lease: page ids, granted generations */
byte dgen[NDP], dwgen[NDP], downer[NDP], dcont[NDP];   /* generation, written_generation, owner, ghost bytes */
byte dfree = NDP;
byte drun;                               /* Scheduler.holding: requests holding a slot (a lease) */
mtype:transfer_state xstate[NREQ];       /* InboundTransfer.state */
byte xnonce[NREQ], xslot[NREQ], xplan[NREQ];
byte xn[NREQ], xw[NREQ], xnext[NREQ];    /* PlanTracker: chunks, written pages (bits), next seq */
byte xfirst[NREQ];                       /* the first-token record of the MANIFEST decode completed with
                                            (wire v4): 0 intact, GARBAGE corrupted; it becomes EV_TOKEN's */
bool dverified[NREQ];                    /* ghost (S3): start_decode's checks passed for r's transfer; set
                                            once, in the step that enters VERIFIED; the router asserts it */
byte rc_st[NSLOT], rc_cid[NSLOT], rc_open[NSLOT], rc_fin[NSLOT], rc_seq[NSLOT];
byte rc_fnonce[NSLOT * NREQ];            /* the codec a connection remembers for an ended request */

/* prefill worker */
byte p_epoch = 1;
mtype:request_state ps[NREQ];
byte pfree = NPP;
byte prun;                               /* Scheduler.holding: requests holding a slot (pages) */
byte pearly;                             /* EarlyBudget.held_pages: of requests without a ticket yet */
byte pearly_n;                           /* EarlyBudget.held_requests: how many requests those are */
#ifdef MUTANT_UNBOUNDED_EARLY            /* prefill computes ahead of every ticket: the pools deadlock */
#define EARLY_LIMIT NPP
#else
#define EARLY_LIMIT (NPP - MAXNEED)      /* the pool less one full context */
#endif
/* EarlyBudget.limit_requests: max_running_requests - 1, so a request with its ticket always finds
 * a running slot. Without it (the code before this bound: only pages were bounded) a burst filled
 * prefill's slots with requests computed ahead whose tickets never came -- decode's slots held
 * requests waiting for prefill -- well within the page bound (found by a burst probe, not by the
 * model, which had no slots then: formal/README.md) */
#ifdef MUTANT_EARLY_TAKES_EVERY_SLOT
#define EARLY_REQS NREQ
#else
#define EARLY_REQS (PRUN - 1)
#endif
byte plen[NREQ];
mtype:transfer_state pxs[NREQ];          /* OutboundTransfer.state */
byte presult[NREQ];
byte pc_st, pc_slot, pc_cid, pc_epoch, pc_hn, pc_seq;
byte psending;                           /* _OutboundConnection.sending (bits) */
byte cred, unacked;                      /* ByteCredit.in_use, the connection's unacked bytes */

/* network */
byte nst[NSLOT];
chan p2d[NSLOT] = [QLEN] of { mtype:frame, byte, byte, byte, byte, byte, byte, byte, byte, bit };
                 /* type, rid, nonce, cid, seq, page, gen, tag, connection seq, adversary's */
chan d2p[NSLOT] = [DQLEN] of { mtype:frame, byte, byte, byte, byte };
                 /* type, rid, nonce, cid, value (WELCOME: epoch; RESULT: ok) */
byte ackq[NSLOT];                        /* ACK credit decode wrote and prefill has not read (coalesced) */
byte next_cid, next_slot;
byte inflight;                           /* ghost: prefill's chunks written and not yet consumed */
bool silent_fault;

/* adversary: one captured frame */
bool adv_have;
mtype:frame adv_t;
byte adv_rid, adv_nonce, adv_cid, adv_seq, adv_page, adv_gen, adv_tag, adv_cs;

bool prompt;                             /* this row's timers: see Bounds */
bool router_intake = true;               /* the router rejects over-length requests (row 11: it does not) */
bool derr_any;                           /* derr also while waiting for pages, PREALLOCATED, RECEIVING (row 12) */
byte b_disc, b_perr, b_derr, b_reset, b_drop, b_corrupt, b_drestart, b_prestart, b_replay, b_expire, b_tmo;
byte b_lose;                             /* row 14: the router's abort call to a worker fails (Router._send_aborts
                                            logs a timeout or a connection error and goes on) */
byte b_rhang;                            /* rows 9, 10, 15: the router hangs (R_HUNG) */
bool pwait[NREQ];                        /* ghost: prefill awaits r's ticket (p_await_ticket): its bootstrap
                                            timer is armed (ARMED) */

inline spend_timer() {
  if
  :: b_tmo > 0 -> b_tmo--
  :: else -> skip
  fi
}

/* ------------------------------------------------------------------------------ decode's pool */

/* KVPool.allocate: the lowest free pages; each page's generation is bumped and granted. The lease
 * holds one of the scheduler's running slots (Scheduler._allocate_head) until it is freed. */
inline d_alloc(r) {
  i = 0; k = 0;
  do
  :: k == NEED(r) -> break
  :: else ->
     if
     :: downer[i] == 0 ->
        dgen[i]++; downer[i] = r + 1;
        lpage[r * MAXNEED + k] = i; lgen[r * MAXNEED + k] = dgen[i]; k++
     :: else -> skip
     fi;
     i++
  od;
  dfree = dfree - NEED(r); dlease[r] = true; drun++
}

/* KVPool.free: release what the lease still owns; a freed page is stale for every old lease.
 * Scheduler.remove: the slot goes with it. */
inline d_free(r) {
  if
  :: dlease[r] ->
     k = 0;
     do
     :: k == NEED(r) -> break
     :: else ->
        i = lpage[r * MAXNEED + k];
        if
        :: downer[i] == r + 1 && dgen[i] == lgen[r * MAXNEED + k] -> downer[i] = 0; dgen[i]++; dfree++
        :: else -> skip
        fi;
        k++
     od;
     dlease[r] = false; drun--
  :: else -> skip
  fi
}

/* KVPool.lease_written, engine.start_decode's S3 check: every page current for the lease and
 * written in its current generation. */
inline lease_written(r, result) {
  result = dlease[r]; k = 0;
  do
  :: k == NEED(r) -> break
  :: else ->
     i = lpage[r * MAXNEED + k];
     result = result && downer[i] == r + 1 && dgen[i] == lgen[r * MAXNEED + k] && dwgen[i] == dgen[i];
     k++
  od
}

/* ghost: every page of r's lease holds r's own KV, written for this lease in the page's current
 * generation -- what S1 and S3 mean by "written for it". */
inline holds_own_kv(r, result) {
  result = dlease[r]; k = 0;
  do
  :: k == NEED(r) -> break
  :: else ->
     i = lpage[r * MAXNEED + k];
     result = result && downer[i] == r + 1 && dgen[i] == lgen[r * MAXNEED + k] &&
              dwgen[i] == dgen[i] && dcont[i] == TAG(r, k);
     k++
  od
}

/* ------------------------------------------------------------------------------ decode: KVReceiver */

/* _return_credit + _flush_credit. ACKs are coalesced (one names every byte consumed since the last):
 * the ACK in flight is a count per connection that prefill's reader takes. */
inline ack(c) {
  if
  :: nst[c] == NET_UP -> ackq[c]++
  :: else -> skip
  fi
}

/* KVReceiver._finish/_fail: the transfer ends; the connection remembers its codec (late frames are
 * verified, then dropped); prefill is told in a RESULT (notify). */
inline x_end(r, state, notify, why) {
  if
  :: xstate[r] == T_EXPECTED || xstate[r] == T_OPEN ->
     printf("MSC: r%d decode transfer %e (%e)\n", r, state, why);
     if
     :: xstate[r] == T_OPEN ->
        j = xslot[r];
        rc_open[j] = rc_open[j] & ~BIT(r); rc_fin[j] = rc_fin[j] | BIT(r); rc_fnonce[j * NREQ + r] = xnonce[r];
        if
        :: notify && nst[j] == NET_UP && rc_st[j] == RC_UP ->
           QSIZE = len(d2p[j]) < DQLEN; assert(QSIZE);
           d2p[j]!RESULT, r, xnonce[r], rc_cid[j], ((state == T_COMPLETE) -> RES_OK : RES_FAIL)
        :: else -> skip
        fi
     :: else -> skip
     fi;
     xstate[r] = state
  :: else -> skip
  fi
}

/* _serve's finally: every transfer opened on the connection fails (no RESULT: it is gone). */
inline rc_close(c, why) {
  printf("MSC: decode closes connection %d (%e)\n", c, why);
  j = 0;
  do
  :: j == NREQ -> break
  :: else ->
     if
     :: rc_open[c] & BIT(j) -> rc_open[c] = rc_open[c] & ~BIT(j); xstate[j] = T_FAILED;
        printf("MSC: r%d decode transfer T_FAILED (%e)\n", j, why)
     :: else -> skip
     fi;
     j++
  od;
  rc_st[c] = RC_CLOSED
}
inline rc_abandon(c, why) {                              /* decode closes the connection itself */
  rc_close(c, why); nst[c] = NET_FIN
}

/* The ticket layer. A request frame (OPEN, CHUNK, MANIFEST, ABORT, RESULT) is MAC'd with the request
 * key HKDF(ticket nonce, connection id): it verifies only with that ticket on that connection, and
 * decode takes CHUNK/MANIFEST/ABORT only for a transfer OPENed on the connection they arrive on. */
#if BOUND
#define FRAME_MAC_OK(c, n) (f_cid == rc_cid[c] && f_nonce == (n))
#define OPENED_HERE(c, r)  (rc_open[c] & BIT(r))
#else
#define FRAME_MAC_OK(c, n) (true)
#define OPENED_HERE(c, r)  (xstate[r] == T_OPEN)
#endif
#define TICKET_ISSUED(n, r) ((n) != 0 && (n) <= nonces && tk_rid[n] == (r))

/* _drop_late: a frame for a request not open here. One that ended or was refused on this connection
 * is verified and dropped (a CHUNK's credit goes back); anything else closes the connection. */
inline late_frame(c) {
  if
  :: (rc_fin[c] & BIT(f_rid)) && f_cid == rc_cid[c] && f_nonce == rc_fnonce[c * NREQ + f_rid] ->
     printf("MSC: r%d decode drops a late %e\n", f_rid, f_t);
     if :: f_t == CHUNK -> ack(c) :: else -> skip fi
  :: else -> rc_abandon(c, PROTOCOL_ERROR)
  fi
}

inline on_chunk(c) {
  r = f_rid;
  /* PlanTracker.check_chunk: a planned page with its planned generation, once, seq increasing */
  k = 0; found = false;
  do
  :: k == xplan[r] -> break
  :: else ->
     if
     :: lpage[r * MAXNEED + k] == f_page && lgen[r * MAXNEED + k] == f_gen -> found = true; break
     :: else -> k++
     fi
  od;
  if
  :: PLAN_CHECK && (!found || f_seq < xnext[r] || (xw[r] & BIT(k))) -> x_end(r, T_FAILED, true, PLAN_MISMATCH)
  :: else ->
     if
     :: f_tag == GARBAGE -> x_end(r, T_FAILED, true, CHECKSUM)
     :: else ->
        /* DecodeJob.write_pages -> KVPool.import_pages (S5). write_pages' own `lease.released`
         * test is not a guard here: the engine thread (AsyncEngine._step's abort, or the abort the
         * handler awaits) may free the lease between it and import_pages, whose check under the
         * pool's lock is the one that holds; the model takes that order (a refused write fails the
         * transfer either way, UNKNOWN_REQUEST or STALE). */
        if
        :: !djob[r] -> x_end(r, T_FAILED, true, UNKNOWN_REQUEST)
        :: else ->
           if :: ds[r] == PREALLOCATED -> ds[r] = RECEIVING :: else -> skip fi;
           i = f_page;
           if
           :: GEN_CHECK && !(dlease[r] && downer[i] == r + 1 && dgen[i] == f_gen) ->
              printf("MSC: r%d decode drops a stale write to page %d\n", r, i);
              x_end(r, T_FAILED, true, STALE)
           :: else ->
              S5 = downer[i] == r + 1 && dgen[i] == f_gen; assert(S5);
              NOREPLAY = !f_adv; assert(NOREPLAY);
              dwgen[i] = f_gen; dcont[i] = f_tag;
              printf("MSC: r%d decode writes page %d gen %d (KV of r%d)\n", r, i, f_gen, (f_tag - 1) / MAXNEED);
              if
              :: xstate[r] == T_OPEN -> xw[r] = xw[r] | BIT(k); xnext[r] = f_seq + 1; xn[r]++
              :: else -> skip
              fi
           fi
        fi
     fi
  fi
}

inline on_manifest(c) {
  r = f_rid;
  if
  :: CHECK_MANIFEST && !(f_seq == xn[r] && f_page == xw[r] && xw[r] == (1 << xplan[r]) - 1) ->
     x_end(r, T_FAILED, true, MANIFEST_MISMATCH)
  :: else ->
     if
     :: MANIFEST_CHECKSUM && f_tag == GARBAGE ->        /* v4: the first-token record's checksum (S3) */
        x_end(r, T_FAILED, true, CHECKSUM)
     :: else ->
        if
        :: !djob[r] -> x_end(r, T_FAILED, true, UNKNOWN_REQUEST)
        :: else -> NOREPLAY = !f_adv; assert(NOREPLAY); xfirst[r] = f_tag; x_end(r, T_COMPLETE, true, T_COMPLETE)
        fi
     fi
  fi
}

/* KVReceiver._on_open and _refusal (S9): the ticket must be the router's, the frame MAC'd for this
 * connection; then the boot epoch, a live transfer, its nonce and pages, and that it is not open yet.
 * A refusal answers on this connection and leaves the transfer alone. */
inline on_open(c) {
  r = f_rid;
  if
  :: !TICKET_ISSUED(f_nonce, r) -> rc_abandon(c, TICKET)                  /* not the router's ticket */
  :: BOUND && f_cid != rc_cid[c] -> rc_abandon(c, PROTOCOL_ERROR)         /* HmacError */
  :: else ->
     found = false;
     if
     :: b_expire > 0 -> b_expire--; found = true                         /* expired meanwhile */
     :: true -> skip
     fi;
     if
     :: !found && (!EPOCH_CHECK || tk_epoch[f_nonce] == d_epoch) && djob[r] && (!OPEN_NONCE || xnonce[r] == f_nonce) &&
        xstate[r] == T_EXPECTED ->
        NOREPLAY = !f_adv; assert(NOREPLAY);
        xstate[r] = T_OPEN; xslot[r] = c; rc_open[c] = rc_open[c] | BIT(r);
        printf("MSC: r%d decode transfer T_OPEN on connection %d\n", r, c)
     :: else ->
        printf("MSC: r%d decode refuses OPEN (%e)\n", r, TICKET);
        rc_fin[c] = rc_fin[c] | BIT(r); rc_fnonce[c * NREQ + r] = f_nonce;
        QSIZE = len(d2p[c]) < DQLEN; assert(QSIZE);
        d2p[c]!RESULT, r, f_nonce, rc_cid[c], RES_FAIL
     fi
  fi
}

inline dispatch(c) {
  if
  :: CONN_SEQ && f_cs != rc_seq[c] + 1 -> rc_abandon(c, PROTOCOL_ERROR)  /* v3: not the next frame */
  :: else ->
     rc_seq[c] = f_cs;
     if
     :: f_t == HELLO || f_t == WELCOME || f_t == ACK || f_t == RESULT -> rc_abandon(c, PROTOCOL_ERROR)
     :: f_t == OPEN -> on_open(c)
     :: else ->
        if
        :: !OPENED_HERE(c, f_rid) -> late_frame(c)
        :: else ->
           if
           :: !FRAME_MAC_OK(c, xnonce[f_rid]) -> rc_abandon(c, PROTOCOL_ERROR)   /* HmacError */
           :: else ->
              if
              :: f_t == CHUNK -> on_chunk(c); ack(c)
              :: f_t == MANIFEST -> on_manifest(c)
              :: f_t == ABORT -> NOREPLAY = !f_adv; assert(NOREPLAY); x_end(f_rid, T_FAILED, false, PEER_ABORT)
              fi
           fi
        fi
     fi
  fi
}

/* One TCP connection as decode's KVReceiver._serve sees it. */
proctype receiver(byte c) {
  mtype:frame f_t; byte f_rid, f_nonce, f_cid, f_seq, f_page, f_gen, f_tag, f_cs; bit f_adv;
  byte r, i, j, k; bool found;
end_rx:
  do
  :: atomic { rc_st[c] == RC_IDLE && nst[c] == NET_UP && nempty(p2d[c]) ->
       p2d[c]?f_t, f_rid, f_nonce, f_cid, f_seq, f_page, f_gen, f_tag, f_cs, f_adv;
       if
       :: f_t == HELLO ->                                /* _handshake: WELCOME, a fresh nonce, the epoch */
          next_cid++; rc_cid[c] = next_cid; rc_st[c] = RC_UP; rc_seq[c] = f_cs;
          d2p[c]!WELCOME, f_nonce, 0, rc_cid[c], d_epoch
       :: else -> rc_st[c] = RC_CLOSED; nst[c] = NET_FIN
       fi }
  :: atomic { rc_st[c] == RC_UP && nst[c] == NET_UP && nempty(p2d[c]) ->
       p2d[c]?f_t, f_rid, f_nonce, f_cid, f_seq, f_page, f_gen, f_tag, f_cs, f_adv;
       if :: f_t == CHUNK && !f_adv -> inflight-- :: else -> skip fi;
       dispatch(c);
       if
       :: nst[c] == NET_FIN ->                           /* decode closed it: what is in flight is lost */
          do
          :: nempty(p2d[c]) -> p2d[c]?f_t, f_rid, f_nonce, f_cid, f_seq, f_page, f_gen, f_tag, f_cs, f_adv;
             if :: f_t == CHUNK && !f_adv -> inflight-- :: else -> skip fi
          :: empty(p2d[c]) -> break
          od
       :: else -> skip
       fi }
  :: atomic { rc_st[c] == RC_UP && nst[c] == NET_RST -> rc_close(c, CONNECTION_LOST) }
  od
}

/* ------------------------------------------------------------------------------ decode: the handler */

/* The handler's finally (DecodeServer.decode, _decode): WorkerRuntime.jobs.release, and
 * DecodeServer._release: job.transfer.cancel (RESULT tells prefill) and engine.abort (the pages are
 * freed, S4). */
inline d_release(r) {
  djob[r] = false;
  x_end(r, T_FAILED, true, CANCELLED);
  d_free(r)
}

/* Writing an event to a router that went away fails (ConnectionResetError: cause CLIENT_DISCONNECT).
 * Under MUTANT_NO_ABORT_PROPAGATION (the no_abort_propagation fault) that release leaves the request
 * and its pages behind. */
#define ROUTER_THERE (!rgone[r])
/* D_GONE: a router that ended the request closes its decode call (Router._end_legs, after its
 * aborts, sent or failed), which cancels this handler while it waits (aiohttp's
 * handler_cancellation): its finally releases the request (DecodeServer._release) -- the way out
 * when the abort call was lost (row 14) or overtook the call. Under the no_abort_propagation fault
 * that release, a client disconnect's, leaves the pages behind (d_gone). */
inline d_gone(r) {
  if
  :: PROPAGATE -> d_release(r)
  :: else -> djob[r] = false; printf("MSC: r%d decode leaves its pages behind\n", r)
  fi
}
inline d_state(r, st) {
  ds[r] = st; printf("MSC: r%d decode %e\n", r, st)
}

proctype decode_handler(byte r) {
  byte boot, i, j, k; bool ok;
end_idle:
  do
  :: atomic { dq[r] == MSG_SENT && abort_d[r] == MSG_SENT -> abort_d[r] = MSG_LOST }   /* abort first: a no-op */
  :: atomic { dq[r] == MSG_SENT -> dq[r] = MSG_TAKEN; boot = d_epoch; d_state(r, RECEIVED);
       /* intake (S2): the engine's check_fits */
       if
       :: over[r] && !UNSAFE_REJECT_PATH && D_INTAKE -> d_state(r, REJECTED);
          if :: ROUTER_THERE -> dstream[r]!EV_ERROR, 0 :: else -> skip fi; goto end   /* HTTP 400 */
       :: else -> d_state(r, ADMITTED)
       fi }; break
  od;
  /* engine.preallocate: wait for pages and a running slot (FIFO in code; in any order here) */
  do
  :: atomic { d_epoch == boot && dfree >= NEED(r) && drun < DRUN ->
       S2 = !CHECK_S2 || !over[r]; assert(S2);           /* an over-length request allocates nothing */
       d_alloc(r); djob[r] = true; d_state(r, PREALLOCATED);
       printf("MSC: r%d decode lease pages %d,%d gen %d,%d\n", r, lpage[r * MAXNEED], lpage[r * MAXNEED + 1],
              lgen[r * MAXNEED], lgen[r * MAXNEED + 1]);
       /* KVReceiver.expect: plan the transfer, draw the ticket nonce */
       nonces++; xnonce[r] = nonces; xstate[r] = T_EXPECTED; xn[r] = 0; xw[r] = 0; xnext[r] = 0;
       xplan[r] = (UNSAFE_REJECT_PATH && over[r] -> 1 : NEED(r));   /* the incident's decode plans 1 token */
       tk_rid[nonces] = r; tk_epoch[nonces] = d_epoch;
       k = 0;
       do
       :: k == MAXNEED -> break
       :: else -> tk_page[nonces * MAXNEED + k] = lpage[r * MAXNEED + k];
                  tk_gen[nonces * MAXNEED + k] = lgen[r * MAXNEED + k]; k++
       od;
       if
       :: ROUTER_THERE -> dstream[r]!EV_BOOTSTRAP, nonces
       :: else -> d_gone(r); d_state(r, ABORTED); goto end
       fi };
     break
  :: atomic { d_epoch == boot && abort_d[r] == MSG_SENT && PROPAGATE ->
       abort_d[r] = MSG_TAKEN; d_state(r, ABORTED); goto end }
  :: atomic { d_epoch == boot && rgone[r] && D_GONE_WATCH && PROPAGATE -> d_state(r, ABORTED); goto end }   /* D_GONE */
  :: atomic { d_epoch == boot && derr_any && b_derr > 0 -> b_derr--;   /* AsyncEngine._step fails: engine.abort */
       d_state(r, ABORTED);                              /* preallocate returns no lease: 503 aborted */
       if :: ROUTER_THERE -> dstream[r]!EV_ERROR, 0 :: else -> skip fi; goto end }
  :: d_epoch != boot -> goto end
  od;
  /* job.transfer.wait() (InboundTransfer.wait): the transfer's outcome, or an abort */
  do
  :: atomic { d_epoch == boot && xstate[r] == T_COMPLETE ->
       /* MUTANT_TOKEN_FIRST: the first token goes to the router before start_decode's checks */
       if :: TOKEN_FIRST && ROUTER_THERE -> dstream[r]!EV_TOKEN, xfirst[r] :: else -> skip fi;
       /* engine.start_decode: the request is still PREALLOCATED/RECEIVING (_get; else
        * InvalidRequest), and S3 */
       lease_written(r, ok);
       if
       :: (START_STATE_CHECK && ds[r] == ABORTED) || (VERIFY_WRITTEN && !(UNSAFE_REJECT_PATH && over[r]) && !ok) ->
          d_state(r, ABORTED);                           /* InvalidRequest or KVNotWritten: this request only */
          if :: ROUTER_THERE -> dstream[r]!EV_ERROR, 0; d_release(r) :: else -> d_gone(r) fi;
          goto end
       :: else ->
          d_state(r, VERIFIED); dverified[r] = true;       /* ghost (S3): checked at the router */
          holds_own_kv(r, ok); S3 = ok; assert(S3);             /* decode starts only on verified KV */
          if
          :: ROUTER_THERE ->                            /* the first token: the MANIFEST's record */
             if :: !TOKEN_FIRST -> dstream[r]!EV_TOKEN, xfirst[r] :: else -> skip fi; d_state(r, DECODING)
          :: else -> d_state(r, ABORTED); d_gone(r); goto end
          fi
       fi }; break
  :: atomic { d_epoch == boot && xstate[r] == T_FAILED ->
       d_state(r, ABORTED);
       if :: ROUTER_THERE -> dstream[r]!EV_ERROR, 0; d_release(r) :: else -> d_gone(r) fi; goto end }
  :: atomic { d_epoch == boot && abort_d[r] == MSG_SENT && PROPAGATE ->
       abort_d[r] = MSG_TAKEN; d_state(r, ABORTED);
       if
       :: FREE_BEFORE_CANCEL -> d_free(r)                /* mutant: the pages go, the transfer stays open */
       :: else -> d_release(r); goto end
       fi };
     atomic { djob[r] = false; x_end(r, T_FAILED, true, CANCELLED); goto end }   /* (mutant) the cancel, later */
  :: atomic { d_epoch == boot && rgone[r] && D_GONE_WATCH -> d_state(r, ABORTED); d_gone(r); goto end }   /* D_GONE */
  :: atomic { D_TIMER && d_epoch == boot && (xstate[r] == T_EXPECTED || xstate[r] == T_OPEN) && TIMER ->
       spend_timer(); x_end(r, T_FAILED, true, TIMEOUT) }          /* the open timer (EXPECTED), the stall timer (OPEN) */
  :: atomic { d_epoch == boot && derr_any && b_derr > 0 && ds[r] != ABORTED -> b_derr--;
       /* AsyncEngine._step fails outside a forward pass: engine.abort of every live request, this
        * one PREALLOCATED or RECEIVING: its pages are freed (and may be granted to another request
        * at once) while its transfer stays open. Nobody tells the handler, which awaits the
        * transfer on: the next CHUNK is refused (write_pages / import_pages: S5), a MANIFEST
        * completes it and start_decode refuses the request, or the router's abort or a timer ends
        * it; each fails the transfer with a RESULT to prefill. */
       d_free(r); d_state(r, ABORTED) }
  :: d_epoch != boot -> goto end
  od;
  /* DECODING: every step reads the request's pages */
  do
  :: atomic { d_epoch == boot ->
       holds_own_kv(r, ok); S1 = ok; assert(S1);         /* every read: the request's own KV */
       djob[r] = false; d_free(r); d_state(r, FINISHED); /* the engine retires it */
       if :: ROUTER_THERE -> dstream[r]!EV_FINISH, 0 :: else -> skip fi; goto end }
  :: atomic { d_epoch == boot && b_derr > 0 -> b_derr--;  /* the engine fails the request */
       djob[r] = false; d_free(r); d_state(r, ABORTED);
       if :: ROUTER_THERE -> dstream[r]!EV_ERROR, 0 :: else -> skip fi; goto end }
  :: atomic { d_epoch == boot && abort_d[r] == MSG_SENT && PROPAGATE ->
       abort_d[r] = MSG_TAKEN; djob[r] = false; d_free(r); d_state(r, ABORTED); goto end }
  :: atomic { d_epoch == boot && rgone[r] && D_GONE_WATCH -> d_state(r, ABORTED); d_gone(r); goto end }   /* D_GONE */
  :: d_epoch != boot -> goto end
  od;
end:
  skip
}

/* ------------------------------------------------------------------------------ prefill: KVSender */

#define PNEED(r) ((UNSAFE_REJECT_PATH && over[r]) -> 1 : NEED(r))   /* the incident: a placeholder */

/* Write a frame of request r on the pooled connection (a dead socket swallows it); the adversary may
 * keep a copy. */
inline p_send(t, seq_, page_, gen_, tag_) {
  if
  :: nst[pc_slot] == NET_UP ->
     QSIZE = len(p2d[pc_slot]) < QLEN; assert(QSIZE);
     pc_seq++;
     p2d[pc_slot]!t, r, n, pc_cid, seq_, page_, gen_, tag_, pc_seq, 0;
     if :: t == CHUNK -> inflight++ :: else -> skip fi;
     if
     :: b_replay > 0 && !adv_have ->
        adv_have = true; adv_t = t; adv_rid = r; adv_nonce = n; adv_cid = pc_cid;
        adv_seq = seq_; adv_page = page_; adv_gen = gen_; adv_tag = tag_; adv_cs = pc_seq
     :: true -> skip
     fi
  :: else -> skip
  fi
}

/* The rest of KVSender._open, in the step that found the connection (no await between): a WELCOME
 * epoch other than the ticket's means decode restarted since it granted the pages -- nothing is
 * sent (TICKET); else OPEN is written and the transfer registered on the connection. */
inline open_on_conn() {
  if
  :: EPOCH_CHECK && pc_epoch != tk_epoch[n] -> ok = false; pxs[r] = T_FAILED;
     printf("MSC: r%d prefill transfer T_FAILED (%e)\n", r, TICKET)
  :: else ->
     ok = true; presult[r] = 0; psending = psending | BIT(r); p_send(OPEN, 0, 0, 0, 0); pxs[r] = T_OPEN
  fi
}

/* KVSender._open/_connection: reuse the pooled connection, or connect: HELLO, and decode's WELCOME
 * must echo its nonce (one handshake at a time: the pool's open_lock). Sets ok when OPEN went out. */
inline p_open() {
  atomic { if :: p_epoch == boot -> pxs[r] = T_CONNECTING :: else -> skip fi };   /* a dead process does nothing */
  ok = false;
  do
  :: atomic { p_epoch == boot && pc_st == PC_UP -> open_on_conn() }; break
  :: atomic { p_epoch == boot && pc_st == PC_NONE ->
       if
       :: next_slot < PSLOTS ->
          pc_slot = next_slot; next_slot++; nst[pc_slot] = NET_UP; pc_st = PC_HELLO; pc_hn++; pc_seq = 1; ok = true;
          p2d[pc_slot]!HELLO, 0, pc_hn, 0, 0, 0, 0, 0, pc_seq, 0
       :: else -> ok = false; pxs[r] = T_FAILED           /* cannot connect (the model's last slot) */
       fi };
     if
     :: !ok -> break
     :: else -> skip
     fi;
     ok = false;
     do
     :: atomic { p_epoch == boot && nempty(d2p[pc_slot]) ->
          d2p[pc_slot]?f_t, f_rid, f_nonce, f_cid, f_val;
          if
          :: f_t == WELCOME && f_rid == pc_hn -> pc_cid = f_cid; pc_epoch = f_val; pc_st = PC_UP; open_on_conn()
          :: else -> pc_st = PC_NONE; nst[pc_slot] = NET_GONE; pxs[r] = T_FAILED   /* ProtocolError */
          fi }; break
     :: atomic { p_epoch == boot && nst[pc_slot] != NET_UP && empty(d2p[pc_slot]) ->
          pc_st = PC_NONE; pxs[r] = T_FAILED }; break                           /* connection lost */
     :: atomic { P_SEND_TIMER && p_epoch == boot && QUIET_TIMER ->
          pc_st = PC_NONE; nst[pc_slot] = NET_GONE; pxs[r] = T_FAILED }; break   /* connect_timeout_s */
     :: p_epoch != boot -> break
     od;
     break
  :: p_epoch != boot -> break
  od
}

/* ------------------------------------------------------------------------------ prefill: the handler */

inline p_free(r) {                       /* engine.abort / engine.release: pages and slot */
  if :: plen[r] > 0 -> prun-- :: else -> skip fi;
  pfree = pfree + plen[r]; plen[r] = 0
}
/* EarlyBudget.give: an early request's claim ends (its ticket came, or it ended) */
inline early_give() {
  if :: early > 0 -> pearly = pearly - early; pearly_n-- :: else -> skip fi;
  early = 0
}
/* PrefillServer._ticket_of: await job.arrival, the ticket (S9: before it, nothing is sent and
 * nothing connected; KV computed ahead of it was computed on the router's signed call alone).
 * P_GONE: a router that ended the request cancelled its prefill call, which closes the call's
 * connection and so cancels this handler (aiohttp's handler_cancellation): the one way out when the
 * router's abort overtook the call and was a no-op (found by this model when the legs were first
 * started together). A router that hangs without closing is prefill's own bootstrap timer's
 * (`--bootstrap-timeout`). The ticket ends an early request's claim on the budget. */
/* The ghost pwait[r] is set in the step before the wait (the intake for a request that waits first,
 * the computing step for one computed ahead) and cleared in every step that leaves it: a function of
 * the handler's place, so it adds no state; ARMED reads it. */
inline p_await_ticket() {
  do
  :: atomic { p_epoch == boot && tq[r] == MSG_SENT -> tq[r] = MSG_TAKEN; n = tk[r]; pwait[r] = false;
       if
       :: b_expire > 0 -> b_expire--; p_free(r); p_state(r, ABORTED); pres[r] = PRES_ERR; goto end  /* 403 invalid_ticket */
       :: true -> early_give()
       fi }; break
  :: atomic { p_epoch == boot && abort_p[r] == MSG_SENT -> abort_p[r] = MSG_TAKEN; pwait[r] = false;
       p_free(r); p_state(r, ABORTED); pres[r] = PRES_ERR; goto end }
  :: atomic { p_epoch == boot && rgone[r] -> pwait[r] = false;   /* P_GONE */
       p_free(r); p_state(r, ABORTED); pres[r] = PRES_ERR; goto end }
  :: atomic { P_TIMER && p_epoch == boot && QUIET_TIMER -> pwait[r] = false;   /* --bootstrap-timeout: 504 */
       p_free(r); p_state(r, ABORTED); pres[r] = PRES_ERR; goto end }
  :: atomic { p_epoch != boot -> pwait[r] = false; goto end }
  od
}
inline p_state(r, st) {
  ps[r] = st; printf("MSC: r%d prefill %e\n", r, st)
}
/* A transfer prefill owned has ended: engine.release (DONE) or engine.abort (502). */
inline p_finish(r) {
  psending = psending & ~BIT(r); p_free(r);
  if
  :: presult[r] == RES_OK -> pxs[r] = T_COMPLETE; p_state(r, DONE); pres[r] = PRES_OK
  :: else -> pxs[r] = T_FAILED; p_state(r, ABORTED); pres[r] = PRES_ERR
  fi
}
/* KVSender's except clause: ABORT tells decode to release at once (S4). */
inline p_abort_frame() {
  if :: PROPAGATE -> p_send(ABORT, 0, 0, 0, 0) :: else -> skip fi
}

proctype prefill_handler(byte r) {
  mtype:frame f_t; byte f_rid, f_nonce, f_cid, f_val;
  byte boot, n, seq, tag, early; bool ok;
end_idle:
  do
  :: atomic { pq[r] != MSG_TAKEN && abort_p[r] == MSG_SENT -> abort_p[r] = MSG_LOST }   /* abort first: a no-op */
  :: atomic { pq[r] == MSG_SENT -> pq[r] = MSG_TAKEN; boot = p_epoch;
       p_state(r, RECEIVED);
       if   /* 400, PREFILL_ERROR: no ticket yet, so only the router can tell decode (it does) */
       :: over[r] && !UNSAFE_REJECT_PATH && P_INTAKE -> p_state(r, REJECTED); pres[r] = PRES_ERR; goto end
       :: else -> p_state(r, ADMITTED)
       fi;
       /* EarlyBudget.take, before the engine: compute ahead of the ticket only while requests
        * without one hold at most the pool less one full context, and at most max_running - 1 of
        * them; past either, the ticket first. Without the page bound the pools deadlock
        * (prefill's pages wait for decode's, decode's for prefill: found by this model); without
        * the count bound, the running slots (found by a burst probe). The claim counts from here,
        * while the request still waits for its pages and slot in the engine. */
       if
       :: pearly + PNEED(r) <= EARLY_LIMIT && pearly_n + 1 <= EARLY_REQS ->
          pearly = pearly + PNEED(r); pearly_n++; early = PNEED(r)
       :: else -> early = 0; pwait[r] = true          /* the ticket first: p_await_ticket */
       fi }; break
  od;
  if :: early == 0 -> p_await_ticket() :: else -> skip fi;
  /* engine.prefill: wait for pages and a running slot, compute, sample the first token (one await) */
  do
  :: atomic { p_epoch == boot && pfree >= PNEED(r) && prun < PRUN ->
       S2 = !CHECK_S2 || !over[r]; assert(S2);
       pfree = pfree - PNEED(r); plen[r] = PNEED(r); prun++; p_state(r, PREFILLING);
       /* A prefill error. PrefillServer._prefill tells decode itself (_abort(tell_decode=True))
        * once the job holds its ticket: taken before computing (early == 0), or delivered to the
        * job while an early request computed (tq[r] == MSG_SENT); without one, only the router can. */
       if
       :: b_perr > 0 && early == 0 -> b_perr--; p_free(r); p_state(r, ABORTED); goto tell_decode
       :: b_perr > 0 && early > 0 && tq[r] == MSG_SENT -> b_perr--; tq[r] = MSG_TAKEN; n = tk[r];
          p_free(r); p_state(r, ABORTED); goto tell_decode
       :: b_perr > 0 && early > 0 && tq[r] != MSG_SENT -> b_perr--; p_free(r); p_state(r, ABORTED); pres[r] = PRES_ERR; goto end
       :: true -> p_state(r, TRANSFERRING); pwait[r] = (early > 0)   /* then p_await_ticket */
       fi }; break
  :: atomic { p_epoch == boot && abort_p[r] == MSG_SENT -> abort_p[r] = MSG_TAKEN; p_state(r, ABORTED); pres[r] = PRES_ERR; goto end }
  :: atomic { p_epoch == boot && rgone[r] -> p_state(r, ABORTED); pres[r] = PRES_ERR; goto end }   /* P_GONE */
  :: p_epoch != boot -> goto end
  od;
  if :: early > 0 -> p_await_ticket() :: else -> skip fi;
  /* KVSender.send(ticket, chunks, first) */
  p_open();
  if
  :: !ok -> goto failed
  :: else -> skip
  fi;
  seq = 0;
  do
  :: atomic { p_epoch == boot && seq == PNEED(r) && presult[r] == 0 ->
       /* the MANIFEST carries the first-token record (wire v4), checksummed: tag 0 is the intact
        * record, GARBAGE one corrupted in flight (the corrupt budget: a CHUNK or the MANIFEST) */
       if
       :: b_corrupt > 0 -> b_corrupt--; p_send(MANIFEST, seq, (1 << PNEED(r)) - 1, 0, GARBAGE)
       :: true -> p_send(MANIFEST, seq, (1 << PNEED(r)) - 1, 0, 0)
       fi;
       pxs[r] = T_SEALED }; break
  :: atomic { p_epoch == boot && presult[r] != 0 -> p_finish(r); goto end }  /* decode's verdict came first */
  :: atomic { p_epoch == boot && seq < PNEED(r) && presult[r] == 0 && (cred == 0 || cred + 1 <= CAP) ->
       cred++;                                           /* ByteCredit.acquire (S6) */
       if
       :: b_drop > 0 -> b_drop--; cred--; silent_fault = true;   /* drop_chunk: never written */
          printf("MSC: r%d prefill drops chunk %d\n", r, seq)
       :: true ->
          tag = ((UNSAFE_REJECT_PATH && over[r]) -> PLACEHOLDER : TAG(r, seq));
          if
          :: b_corrupt > 0 -> b_corrupt--; tag = GARBAGE
          :: true -> skip
          fi;
          unacked++;
          p_send(CHUNK, seq, tk_page[n * MAXNEED + seq], tk_gen[n * MAXNEED + seq], tag)
       fi;
       S6 = inflight <= CAP && cred <= CAP; assert(S6);
       seq++ }
  :: atomic { P_SEND_TIMER && p_epoch == boot && seq < PNEED(r) && presult[r] == 0 && !(cred == 0 || cred + 1 <= CAP) && TIMER ->
       spend_timer(); p_abort_frame() }; goto failed           /* the credit wait timed out: TIMEOUT */
  :: atomic { p_epoch == boot && abort_p[r] == MSG_SENT -> abort_p[r] = MSG_TAKEN; p_abort_frame() }; goto failed
  :: atomic { p_epoch == boot && b_perr > 0 -> b_perr--; p_abort_frame() }; goto failed   /* chunks raised */
  :: p_epoch != boot -> goto end
  od;
  /* wait for decode's RESULT */
  do
  :: atomic { p_epoch == boot && presult[r] != 0 -> p_finish(r); goto end }
  :: atomic { P_SEND_TIMER && p_epoch == boot && presult[r] == 0 && TIMER -> spend_timer(); p_abort_frame() }; goto failed  /* TIMEOUT */
  :: atomic { p_epoch == boot && abort_p[r] == MSG_SENT -> abort_p[r] = MSG_TAKEN; p_abort_frame() }; goto failed
  :: p_epoch != boot -> goto end
  od;
failed:                                                  /* the transfer failed or was abandoned */
  atomic {
    if :: p_epoch != boot -> goto end :: else -> skip fi;
    psending = psending & ~BIT(r); pxs[r] = T_FAILED; p_free(r); p_state(r, ABORTED); pres[r] = PRES_ERR;
    goto end };
tell_decode:                                             /* PrefillServer._abort(tell_decode=True) */
  if
  :: PROPAGATE ->                                        /* KVSender.abort: OPEN, then ABORT */
     p_open();
     atomic {
       if
       :: ok && p_epoch == boot -> p_send(ABORT, 0, 0, 0, 0); psending = psending & ~BIT(r); pxs[r] = T_FAILED
       :: else -> skip
       fi;
       if :: p_epoch == boot -> pres[r] = PRES_ERR :: else -> skip fi }
  :: else -> atomic { if :: p_epoch == boot -> pres[r] = PRES_ERR :: else -> skip fi }
  fi;
end:
  atomic { if :: p_epoch == boot -> early_give() :: else -> early = 0 fi }
}

/* KVSender._read_replies: the pooled connection's reader. Its finally releases the connection's
 * credit and fails every transfer on it (CONNECTION_LOST). */
inline p_close() {
  printf("MSC: prefill's connection %d is closed\n", pc_slot);
  pc_st = PC_NONE; cred = cred - unacked; unacked = 0; ackq[pc_slot] = 0;
  j = 0;
  do
  :: j == NREQ -> break
  :: else ->
     if
     :: (psending & BIT(j)) && presult[j] == 0 -> presult[j] = RES_FAIL
     :: else -> skip
     fi;
     j++
  od
}

proctype prefill_reader() {
  mtype:frame f_t; byte f_rid, f_nonce, f_cid, f_val, j, m;
end_pr:
  do
  :: atomic { pc_st == PC_UP && ackq[pc_slot] > 0 && nst[pc_slot] != NET_RST ->   /* ACK */
       m = ackq[pc_slot]; ackq[pc_slot] = 0;
       if :: ACK_CLAMP && m > unacked -> m = unacked :: else -> skip fi;   /* never more than was sent on it */
       unacked = unacked - m; cred = cred - m }
  :: atomic { pc_st == PC_UP && nempty(d2p[pc_slot]) && nst[pc_slot] != NET_RST ->
       d2p[pc_slot]?f_t, f_rid, f_nonce, f_cid, f_val;
       if
       :: f_t == RESULT ->
          if
          :: (psending & BIT(f_rid)) && f_cid == pc_cid && (!RESULT_NONCE || f_nonce == tk[f_rid]) ->
             if :: presult[f_rid] == 0 -> presult[f_rid] = f_val :: else -> skip fi
          :: else -> skip                                /* no longer sending it: dropped */
          fi
       :: else -> p_close(); nst[pc_slot] = NET_GONE     /* ProtocolError */
       fi }
  :: atomic { pc_st == PC_UP && (nst[pc_slot] == NET_RST ||
               (nst[pc_slot] == NET_FIN && empty(d2p[pc_slot]) && ackq[pc_slot] == 0)) -> p_close() }
  od
}

/* ------------------------------------------------------------------------------ router */

/* Router._end_legs (a task of its own, from _generate's finally): both workers get POST
 * /internal/abort (Router._send_aborts; a call may fail: row 14), then the prefill call is cancelled
 * (it may or may not have reached prefill) and the decode stream closed (S4). */
inline abort_both() {
  printf("MSC: r%d router aborts both legs\n", r);
  rgone[r] = true;
  if
  :: pq[r] == MSG_SENT ->
     if
     :: pq[r] = MSG_WITHDRAWN
     :: true -> skip
     fi
  :: else -> skip
  fi;
  if
  :: tq[r] == MSG_SENT ->
     if
     :: tq[r] = MSG_WITHDRAWN
     :: true -> skip
     fi
  :: else -> skip
  fi;
  if
  :: PROPAGATE ->
     if
     :: abort_p[r] = MSG_SENT
     :: b_lose > 0 -> b_lose--; printf("MSC: r%d the abort to prefill is lost\n", r)
     fi;
     if
     :: abort_d[r] = MSG_SENT
     :: b_lose > 0 -> b_lose--; printf("MSC: r%d the abort to decode is lost\n", r)
     fi
  :: else -> skip
  fi
}
inline r_end() {
  rgone[r] = true; rphase[r] = R_ENDED
}
/* The clean end (_follow_legs: decode's FinishEvent, then prefill's answer, legs.cause cleared): the
 * client hears a finished request only if decode finished it and prefill's transfer was verified. */
inline r_clean_end() {
  OUTCOME = ds[r] == FINISHED && ps[r] == DONE; assert(OUTCOME);
  r_end()
}

proctype router(byte r) {
  byte nn;
  atomic {
    rphase[r] = R_INTAKE;
    if
    :: over[r] && !UNSAFE_REJECT_PATH && router_intake -> r_end()   /* S2: 400 context_length_exceeded */
    :: else -> dq[r] = MSG_SENT; pq[r] = MSG_SENT; rphase[r] = R_DECODE_LEG   /* both legs at once */
    fi }
  do
  :: rphase[r] == R_ENDED -> break
  :: atomic { dstream[r]?EV_BOOTSTRAP, nn ->            /* issue the ticket, deliver it to prefill */
       tk[r] = nn; tq[r] = MSG_SENT; rphase[r] = R_STREAMING }
  :: atomic { dstream[r]?EV_TOKEN, nn ->                /* the first token: forwarded to the client */
       S2 = !CHECK_S2 || !over[r]; assert(S2);          /* tokens reach the client at once */
       S3 = dverified[r]; assert(S3);                   /* S3 where the client sees it: decode verified r's KV */
       S3 = nn != GARBAGE; assert(S3);                  /* and the token is the intact MANIFEST's (wire v4) */
       rphase[r] = R_STREAMING }
  /* _generate: prefill's own answer is awaited only before the request ends cleanly */
  :: atomic { rphase[r] == R_WAIT_PREFILL && pres[r] == PRES_OK -> r_clean_end() }; break
  :: atomic { rphase[r] == R_WAIT_PREFILL && pres[r] == PRES_ERR -> abort_both(); r_end() }; break
  :: atomic { WATCH_PREFILL && (rphase[r] == R_DECODE_LEG || rphase[r] == R_STREAMING) && pres[r] == PRES_ERR ->   /* _next_event */
       abort_both(); r_end() }; break
  :: atomic { rphase[r] != R_WAIT_PREFILL && rphase[r] != R_ENDED && dstream[r]?[EV_FINISH, 0] ->
       dstream[r]?EV_FINISH, nn; rphase[r] = R_WAIT_PREFILL }   /* then `await prefill_task` */
#if ERROR_AS_FINISH
  :: atomic { rphase[r] != R_WAIT_PREFILL && rphase[r] != R_ENDED && dstream[r]?[EV_ERROR, 0] ->
       dstream[r]?EV_ERROR, nn; rphase[r] = R_WAIT_PREFILL }   /* mutant: decode's error read as its finish */
#else
  :: atomic { rphase[r] != R_WAIT_PREFILL && rphase[r] != R_ENDED && dstream[r]?[EV_ERROR, 0] ->
       dstream[r]?EV_ERROR, nn; abort_both(); r_end() }; break
#endif
  :: atomic { rphase[r] != R_ENDED && rphase[r] != R_WAIT_PREFILL && dbroken[r] && empty(dstream[r]) ->
       abort_both(); r_end() }; break                   /* (after FINISH decode's stream is not read) */
  :: atomic { rphase[r] != R_ENDED && b_disc > 0 -> b_disc--;
       printf("MSC: r%d the client disconnects\n", r); abort_both(); r_end() }; break
  :: atomic { rphase[r] != R_ENDED && QUIET_TIMER -> abort_both(); r_end() }; break   /* request_timeout_s */
  /* The router hangs (rows 9, 10, 15): partitioned from the workers, or its process stuck. Nothing
   * of it reaches them any more: no abort, no close of its calls (rgone stays false: no D_GONE,
   * P_GONE), no request timer; the calls already on their way arrive. Only the workers' own timers
   * end the request there (decode's open/stall timers, prefill's bootstrap timer: S4). */
  :: atomic { rphase[r] != R_ENDED && b_rhang > 0 -> b_rhang--; rphase[r] = R_HUNG;
       printf("MSC: r%d the router hangs (no abort, no close, no timer)\n", r) }; break
  od
}

/* ------------------------------------------------------------------------------ faults, adversary */

inline rst(s) {                                          /* a TCP reset: both directions lost */
  printf("MSC: connection %d is reset\n", s);
  nst[s] = NET_RST; ackq[s] = 0;
  do
  :: nempty(p2d[s]) -> p2d[s]?f_t, f_rid, f_nonce, f_cid, f_seq, f_page, f_gen, f_tag, f_cs, f_adv;
     if :: f_t == CHUNK && !f_adv -> inflight-- :: else -> skip fi
  :: empty(p2d[s]) -> break
  od;
  do
  :: nempty(d2p[s]) -> d2p[s]?f_t, f_rid, f_nonce, f_cid, f_val
  :: empty(d2p[s]) -> break
  od
}

proctype network() {
  mtype:frame f_t; byte f_rid, f_nonce, f_cid, f_seq, f_page, f_gen, f_tag, f_cs, f_val; bit f_adv;
  byte r, s, j;
end_net:
  do
  :: atomic { b_reset > 0 && psending != 0 && pc_st == PC_UP && nst[pc_slot] == NET_UP ->
       b_reset--; rst(pc_slot) }
  :: atomic { b_drestart > 0 && (dq[0] == MSG_TAKEN || dq[NREQ - 1] == MSG_TAKEN) ->
       b_drestart--; d_epoch++;                          /* decode restarts: new epoch, empty pool */
       printf("MSC: the decode worker restarts (epoch %d)\n", d_epoch);
       j = 0;
       do
       :: j == NDP -> break
       :: else -> dgen[j] = 0; dwgen[j] = 0; downer[j] = 0; dcont[j] = 0; j++
       od;
       dfree = NDP; drun = 0;
       r = 0;
       do
       :: r == NREQ -> break
       :: else ->
          if :: dq[r] == MSG_TAKEN && !rgone[r] -> dbroken[r] = true :: else -> skip fi;
          djob[r] = false; dlease[r] = false; xstate[r] = 0; r++
       od;
       s = 0;
       do
       :: s == NSLOT -> break
       :: else ->
          if :: nst[s] == NET_UP || nst[s] == NET_FIN -> rst(s) :: else -> skip fi;
          /* the old process's connections die with it; the new one accepts unused slots afresh */
          if :: nst[s] != NET_NONE -> rc_st[s] = RC_CLOSED :: else -> skip fi;
          rc_open[s] = 0; rc_fin[s] = 0; s++
       od }
  :: atomic { b_prestart > 0 && (pq[0] == MSG_TAKEN || pq[NREQ - 1] == MSG_TAKEN) ->
       b_prestart--; p_epoch++;                          /* prefill restarts */
       printf("MSC: the prefill worker restarts\n");
       pfree = NPP; prun = 0; pearly = 0; pearly_n = 0; psending = 0; cred = 0; unacked = 0; pc_st = PC_NONE;
       r = 0;
       do
       :: r == NREQ -> break
       :: else ->
          plen[r] = 0; pxs[r] = 0;
          if :: pq[r] == MSG_TAKEN && pres[r] == 0 -> pres[r] = PRES_ERR :: else -> skip fi;  /* its HTTP call fails */
          r++
       od;
       s = 0;
       do
       :: s == PSLOTS -> break
       :: else -> if :: nst[s] == NET_UP || nst[s] == NET_FIN -> rst(s) :: else -> skip fi; s++
       od }
  od
}

/* The adversary holds one captured frame (any frame prefill wrote). It connects to decode's transfer
 * port (HELLO verifies: the revision's own HELLO, replayed) and injects the copy there, verbatim or
 * forged (a MAC made without the revision's keys: cid 0); ONPATH, it also appends copies to
 * prefill's live connection. */
proctype adversary() {
  bit forged;
end_adv:
  do
  :: atomic { ON_PATH && b_replay > 0 && adv_have && pc_st == PC_UP && nst[pc_slot] == NET_UP && len(p2d[pc_slot]) < QLEN ->
       b_replay--;
       if :: forged = 0 :: forged = 1 fi;
       printf("MSC: the adversary injects a copy (forged %d) of %e of r%d into connection %d\n", forged,
              adv_t, adv_rid, pc_slot);
       p2d[pc_slot]!adv_t, adv_rid, adv_nonce, (forged -> 0 : adv_cid), adv_seq, adv_page, adv_gen, adv_tag, adv_cs, 1 }
  :: atomic { b_replay > 0 && nst[ASLOT] == NET_NONE ->
       b_replay--; nst[ASLOT] = NET_UP; p2d[ASLOT]!HELLO, 0, 0, 0, 0, 0, 0, 0, 1, 1 }
  :: atomic { b_replay > 0 && adv_have && nst[ASLOT] == NET_UP && len(p2d[ASLOT]) < QLEN ->
       b_replay--;
       if :: forged = 0 :: forged = 1 fi;
       printf("MSC: the adversary sends a copy (forged %d) of %e of r%d on its own connection\n", forged, adv_t, adv_rid);
       p2d[ASLOT]!adv_t, adv_rid, adv_nonce, (forged -> 0 : adv_cid), adv_seq, adv_page, adv_gen, adv_tag, 2, 1 }
  :: atomic { nst[ASLOT] == NET_UP && nempty(d2p[ASLOT]) -> d2p[ASLOT]?_, _, _, _, _ }   /* reads, ignores */
  od
}

/* ------------------------------------------------------------------------------ S4 at quiescence */

/* Timers still armed: the router's request timer (not a hung router's), decode's open and stall
 * timers, prefill's bootstrap timer (its wait for the ticket) and its send timers. */
#define ARMED(r) ((rphase[r] != R_ENDED && rphase[r] != R_HUNG) || \
                  (D_TIMER && djob[r] && (xstate[r] == T_EXPECTED || xstate[r] == T_OPEN)) || \
                  (P_TIMER && pwait[r]) || \
                  (P_SEND_TIMER && (pxs[r] == T_CONNECTING || pxs[r] == T_OPEN || pxs[r] == T_SEALED)))
#define TIMERS_PENDING (TIMERS_OK && (ARMED(0) || ARMED(1) || ARMED(NREQ - 1) || (P_SEND_TIMER && pc_st == PC_HELLO)))

/* When nothing can happen any more: every request ended on every side, every page on both sides is
 * free, no credit is held, no transfer is live (S4). */
proctype monitor() {
  byte r, p;
end_mon:
  timeout && !TIMERS_PENDING ->
  atomic {
    r = 0;
    do
    :: r == NREQ -> break
    :: else ->
       S4 = S4 && (rphase[r] == R_ENDED || rphase[r] == R_HUNG) && !djob[r] && !dlease[r] && plen[r] == 0 &&
            xstate[r] != T_EXPECTED && xstate[r] != T_OPEN &&
            !(pxs[r] == T_CONNECTING || pxs[r] == T_OPEN || pxs[r] == T_SEALED);
       r++
    od;
    p = 0;
    do
    :: p == NDP -> break
    :: else -> S4 = S4 && downer[p] == 0; p++
    od;
    S4 = S4 && dfree == NDP && pfree == NPP && drun == 0 && prun == 0 && pearly == 0 && pearly_n == 0 &&
         cred == 0 && psending == 0;
    assert(S4)
  }
}

init {
  byte r;
  atomic {
    if
    BOUNDS
    fi;
    if
    :: OVERLEN -> if :: over[NREQ - 1] = true :: true -> skip fi
    :: else -> skip
    fi;
    r = 0;
    do
    :: r == NREQ -> break
    :: else -> run router(r); run decode_handler(r); run prefill_handler(r); r++
    od;
    r = 0;
    do
    :: r == NSLOT -> break
    :: else -> run receiver(r); r++
    od;
    run prefill_reader(); run network(); run adversary(); run monitor()
  }
}
