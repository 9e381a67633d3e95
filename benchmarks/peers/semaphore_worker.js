// Peer worker for benchmarks/peers.py: npm redis-semaphore 5.8.0 on ioredis 5.
//
// Usage: node semaphore_worker.js '<spec JSON>'   (NODE_PATH points at the npm cache)
// spec: {url, key, tasks, limit, hold_ms, warm_s, seconds, out, options}
// Protocol (same as limiters_worker.py): connect, print "ready", read the common start
// (CLOCK_MONOTONIC ns, the clock of Python's time.monotonic_ns) from stdin, sleep until it, run
// `tasks` acquirers until warm_s + seconds after it, write {recs, cpu_s, errors} to spec.out.
// recs is flat: asked, granted, left (ns) per hold; `left` is taken inside the hold, before the
// release, as benchmarks/throughput.py does.
'use strict'

const fs = require('fs')
const readline = require('readline')
const Redis = require('ioredis')
const { Semaphore } = require('redis-semaphore')

const spec = JSON.parse(process.argv[2])
const now = () => Number(process.hrtime.bigint()) // CLOCK_MONOTONIC on Linux (libuv uv_hrtime)
const sleepUntil = (t) => new Promise((resolve) => setTimeout(resolve, Math.max(0, (t - now()) / 1e6)))
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

async function main () {
  // One ioredis connection per process: the library's own usage (README).
  const client = new Redis(spec.url, { lazyConnect: false })
  await client.ping()
  process.stdout.write('ready\n')
  const rl = readline.createInterface({ input: process.stdin })
  const line = await new Promise((resolve) => rl.once('line', resolve))
  rl.close()
  const start = Number(line.trim())
  const lo = start + spec.warm_s * 1e9
  const stop = start + (spec.warm_s + spec.seconds) * 1e9
  await sleepUntil(start)

  const cpu = (async () => {
    await sleepUntil(lo)
    const before = process.cpuUsage()
    await sleepUntil(stop)
    const d = process.cpuUsage(before)
    return (d.user + d.system) / 1e6
  })()

  const recs = []
  let errors = 0
  async function one () {
    let asked
    while ((asked = now()) < stop) {
      // A new Semaphore per acquisition, as in the README (fresh identifier each time).
      const sem = new Semaphore(client, spec.key, spec.limit, spec.options)
      try {
        await sem.acquire()
      } catch (e) {
        errors += 1
        continue
      }
      const granted = now()
      if (granted < stop) await sleep(spec.hold_ms)
      const left = now()
      await sem.release()
      recs.push(asked, granted, left)
    }
  }
  await Promise.all(Array.from({ length: spec.tasks }, one))
  const cpuS = await cpu
  fs.writeFileSync(spec.out, JSON.stringify({ recs, cpu_s: cpuS, errors }))
  client.disconnect()
}

main().catch((e) => {
  console.error(e)
  process.exit(1)
})
