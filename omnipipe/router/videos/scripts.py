"""The video store's Lua scripts: each is one atomic step on a pipeline's keys (their
layout is in router/videos/store.py), so that router replicas share one queue without a
lock service."""

# Takes the queue's head and its lease in one step: no replica sees a job neither queued
# nor leased. An id whose lease someone holds (a sweep about to queue it again) is left
# to them.
TAKE = """
local id = redis.call('LPOP', KEYS[1])
if not id then return false end
redis.call('SREM', KEYS[3], id)
if redis.call('SET', KEYS[2] .. id, ARGV[1], 'NX', 'PX', ARGV[2]) then return id end
return false
"""
# Claims the lease of a job that is neither queued nor leased (its runner went away).
CLAIM = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then return 1 end
return 0
"""
# Queues an id unless it is queued already.
REQUEUE = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
return redis.call('RPUSH', KEYS[1], ARGV[1])
"""
# Renews a lease while this runner holds it. One that ran out while the runner stalled
# is taken back if the job is still `active` (failing, finishing, deleting take it out)
# and no sweep claimed or queued it: a working runner would otherwise drop and rerun it.
RENEW = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if held then return 0 end
if redis.call('SISMEMBER', KEYS[2], ARGV[3]) == 1 then return 0 end
if redis.call('SISMEMBER', KEYS[3], ARGV[3]) == 0 or redis.call('EXISTS', KEYS[4]) == 1 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# The finished job and its content, only while this runner holds its lease and its
# client has not deleted it.
FINISH = """
if redis.call('GET', KEYS[5]) ~= ARGV[4] then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 or redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('EXPIRE', KEYS[4], ARGV[3])
redis.call('SREM', KEYS[6], ARGV[5])
return 1
"""
# Removes a job its client deletes. One still queued is simply gone; one a runner may
# hold (taken from the queue, leased) also gets the flag that tells the runner to stop.
CANCEL = """
local removed = redis.call('LREM', KEYS[1], 0, ARGV[1])
redis.call('SREM', KEYS[9], ARGV[1])
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
redis.call('ZREM', KEYS[6], ARGV[1])
redis.call('SREM', KEYS[7], ARGV[1])
if removed == 0 or redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('SET', KEYS[8], '1', 'EX', ARGV[2])
  return 1
end
return 0
"""
# Queues a new job (2). Under an Idempotency-Key (a fingerprint in ARGV[1]; KEYS[1] the
# key's record): the job the key made instead, if it still exists and the request is the
# same (1), or a refusal if the request differs (0). With ARGV[8] jobs unfinished already,
# none is made (3): a retried create still finds the job its key made.
CREATE = """
if ARGV[1] ~= '' then
  local held = redis.call('GET', KEYS[1])
  if held then
    local fingerprint, id = string.match(held, '^(%x+) (.+)$')
    if fingerprint ~= ARGV[1] then return {0, id} end
    if redis.call('EXISTS', ARGV[7] .. id) == 1 then return {1, id} end
  end
end
if redis.call('SCARD', KEYS[5]) >= tonumber(ARGV[8]) then return {3, ''} end
if ARGV[1] ~= '' then
  redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[6])
end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[4])
local order = tonumber(ARGV[5]) * 1000000 + redis.call('INCR', KEYS[8]) % 1000000
redis.call('ZADD', KEYS[4], string.format('%.0f', order), ARGV[2])
redis.call('SADD', KEYS[5], ARGV[2])
redis.call('RPUSH', KEYS[6], ARGV[2])
redis.call('SADD', KEYS[7], ARGV[2])
return {2, ARGV[2]}
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
