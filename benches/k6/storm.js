// A retry storm for k6 users: 40 closed-loop workers on one key, round-robin over every
// gateway, each answer padded to 100 ms (40 workers offer 400/s), with the other partners'
// normal traffic beside it. The run FAILS (k6 exits non-zero) when the storm key is admitted
// more than its contract allows over the run, b + r*t, or when another partner gets an error.
//
//   k6 run -e GATEWAYS=http://127.0.0.1:8101,http://127.0.0.1:8102,... benches/k6/storm.js
//
// Settings (all -e NAME=VALUE):
//   GATEWAYS      comma-separated gateway base URLs, one per instance (required)
//   DURATION_S    storm length in seconds (120: two minutes)
//   WORKERS       closed-loop storm workers (40)
//   PAD_MS        each storm answer counts as taking at least this long (100; 0 floods)
//   STORM_KEY     the storm's API key (k7-demo-key)
//   K7_RATE       the storm key's contract, tokens a second (10: 600/60s)
//   K7_BURST      the storm key's burst (20)
//   PARTNER_KEYS  the other partners' keys (k11-demo-key,...,k15-demo-key of rules/fleet.json)
//   OTHERS_RATE   the other partners' requests a second in total (100)
//   ROUTE         the route every request takes (/v1/orders)
//
// See benches/k6/README.md. The Rust harness `tollgate fleet` runs the same storm without k6.

import http from 'k6/http';
import { sleep } from 'k6';
import { Counter } from 'k6/metrics';
import exec from 'k6/execution';

function list(name, fallback) {
  return (__ENV[name] || fallback)
    .split(',')
    .map((s) => s.trim())
    .filter((s) => s.length > 0);
}

function number(name, fallback) {
  const raw = __ENV[name];
  if (raw === undefined || raw === '') {
    return fallback;
  }
  const n = Number(raw);
  if (!Number.isFinite(n) || n < 0) {
    throw new Error(`${name}=${raw}: expected a number of 0 or more`);
  }
  return n;
}

const GATEWAYS = list('GATEWAYS', '').map((u) => u.replace(/\/+$/, ''));
if (GATEWAYS.length === 0) {
  throw new Error('GATEWAYS is required: the gateways\' base URLs, comma-separated, one per instance');
}
const DURATION_S = number('DURATION_S', 120);
const WORKERS = number('WORKERS', 40);
const PAD_MS = number('PAD_MS', 100);
const STORM_KEY = __ENV.STORM_KEY || 'k7-demo-key';
const K7_RATE = number('K7_RATE', 10);
const K7_BURST = number('K7_BURST', 20);
const PARTNER_KEYS = list('PARTNER_KEYS', 'k11-demo-key,k12-demo-key,k13-demo-key,k14-demo-key,k15-demo-key');
const OTHERS_RATE = number('OTHERS_RATE', 100);
const ROUTE = __ENV.ROUTE || '/v1/orders';

// Requests still in flight at the end may finish for this long; their admissions count, so
// the bound covers them too.
const GRACE_S = 2;
// The contract over the whole span in which an admission can happen: b + r*t.
const BOUND = Math.floor(K7_BURST + K7_RATE * (DURATION_S + GRACE_S));

const stormAdmitted = new Counter('storm_admitted');
const stormRefused = new Counter('storm_refused_429');
const stormOther = new Counter('storm_other_status');
const partnerOk = new Counter('partner_ok');
const partner429 = new Counter('partner_429');
const partnerErrors = new Counter('partner_errors');

const scenarios = {
  storm: {
    executor: 'constant-vus',
    exec: 'storm',
    vus: WORKERS,
    duration: `${DURATION_S}s`,
    gracefulStop: `${GRACE_S}s`,
  },
};
if (OTHERS_RATE > 0 && PARTNER_KEYS.length > 0) {
  scenarios.partners = {
    executor: 'constant-arrival-rate',
    exec: 'partners',
    rate: OTHERS_RATE,
    timeUnit: '1s',
    duration: `${DURATION_S}s`,
    preAllocatedVUs: Math.max(10, Math.ceil(OTHERS_RATE / 10)),
    maxVUs: Math.max(50, OTHERS_RATE),
    gracefulStop: `${GRACE_S}s`,
  };
}

export const options = {
  scenarios,
  thresholds: {
    // The contract: the storm key may have b + r*t over the run, across every gateway.
    storm_admitted: [`count<=${BOUND}`],
    // The other partners are under their own limits: no error, whatever the storm does.
    partner_errors: ['count==0'],
  },
  // 429 is an expected answer here, not a failed request.
  summaryTrendStats: ['avg', 'p(50)', 'p(99)', 'max'],
};

const expected = http.expectedStatuses({ min: 200, max: 299 }, 429);

export function setup() {
  console.log(
    `storm: ${WORKERS} workers on ${GATEWAYS.length} gateways for ${DURATION_S} s, padded to ${PAD_MS} ms; ` +
      `contract b + r*t = ${K7_BURST} + ${K7_RATE} x ${DURATION_S + GRACE_S} s = ${BOUND}`,
  );
}

export function storm() {
  const started = Date.now();
  // One counter over every storm request of the test: round-robin, as a load balancer.
  const i = exec.scenario.iterationInTest;
  const res = http.get(`${GATEWAYS[i % GATEWAYS.length]}${ROUTE}`, {
    headers: { Authorization: `Bearer ${STORM_KEY}` },
    tags: { traffic: 'storm' },
    responseCallback: expected,
  });
  if (res.status >= 200 && res.status < 300) {
    stormAdmitted.add(1);
  } else if (res.status === 429) {
    stormRefused.add(1);
  } else {
    stormOther.add(1);
  }
  const left = PAD_MS - (Date.now() - started);
  if (left > 0) {
    sleep(left / 1000);
  }
}

export function partners() {
  const i = exec.scenario.iterationInTest;
  // Every partner reaches every gateway: the gateway turns fastest, the partner once a round.
  const gateway = GATEWAYS[i % GATEWAYS.length];
  const key = PARTNER_KEYS[Math.floor(i / GATEWAYS.length) % PARTNER_KEYS.length];
  const res = http.get(`${gateway}${ROUTE}`, {
    headers: { Authorization: `Bearer ${key}` },
    tags: { traffic: 'partners' },
    responseCallback: expected,
  });
  if (res.status >= 200 && res.status < 300) {
    partnerOk.add(1);
  } else if (res.status === 429) {
    partner429.add(1);
  } else {
    partnerErrors.add(1);
  }
}
