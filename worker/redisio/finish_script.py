"""The finish step's Lua script, and how its answer reads (``worker.redisio.stream`` runs it).

One run per batch and shard: it takes the entries still pending on this consumer (one
``XPENDING`` over the batch's id range), writes each reply unless one is already there, copies
dead letters, and acknowledges and deletes with one ``XACK`` and one ``XDEL``. It is flagged
``allow-oom``, so that a full Redis still drains (contract section 4).

A finish Redis refuses for a reason that will not pass never fails the script (contract v3,
section 4): the worker would stop, and at its restart meet the same key again.

- A reply key holding another type than a list (an operator or another program wrote it): no
  reply can be written there, so the entry goes to the dead letters with the reason, and is
  acknowledged. A list there is a reply already written: ours is dropped, as always.
- A dead-letter key that refuses ``XADD`` (another type, an exhausted id space): the reply, if
  any, is still written and the entry acknowledged; the dead letter is lost, and reported.

Both are rare, and the extra commands (``TYPE``; ``LTRIM key 0 -1`` to tell a list from the
rest where ``RENAMENX`` found a key, a write-only test the worker's ACL user may run) run only on
those paths: a batch's cost is unchanged.

A dead letter copies only ``rid`` and ``body`` (each once; a value over ``max_request_bytes``
is replaced by a note of its size) and names, without copying, up to eight other fields in its
``reason``: a hostile entry cannot make the dead-letter stream hold more than the request limit.
Its field ``lane`` is the stream it came from (contract section 7: the shard's lanes share one
dead-letter stream).

The answer is the per-entry flags as one string (see ``FLAGS``) when nothing was refused, else
an array: those flags, then one ``[index, what, detail, held]`` per refusal (``what``: ``reply``
or ``dead``; ``held``: what the key holds, in words).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FINISH_LUA", "FLAGS", "Refused", "read_answer"]

FINISH_LUA = """#!lua flags=allow-oom
local stream, dead, group, me = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local n, lo, hi, span = tonumber(ARGV[3]), ARGV[4], ARGV[5], tonumber(ARGV[6])
local bound = tonumber(ARGV[7])
-- After FLUSHALL, or a restart without persistence, the group is gone (NOGROUP): nothing is
-- ours to finish. Any other error stops the script and reaches the worker.
local function pending(from, to, count)
  local page = redis.pcall('XPENDING', stream, group, from, to, count, me)
  if type(page) == 'table' and page.err then
    if string.sub(page.err, 1, 7) == 'NOGROUP' then return {}, nil end
    return nil, page
  end
  return page, nil
end
-- What a key that refused a write holds, as words: 'a string', or 'another type' where the
-- worker's ACL user may not run TYPE there (docs/security.md grants it no reads of replies).
local function held(key)
  local t = redis.pcall('TYPE', key)
  if type(t) == 'table' and t.err then return 'another type' end
  return 'a ' .. (t.ok or t)
end
-- A reply inside the script. One already there stands: ours is trimmed off again. Returns what
-- a key of another type holds. Write-only commands: the worker's ACL user reads no reply.
local function push(reply, data, ttl)
  local length = redis.pcall('RPUSH', reply, data)
  if type(length) == 'table' and length.err then
    if string.sub(length.err, 1, 9) == 'WRONGTYPE' then return held(reply) end
    return redis.error_reply(length.err .. ' (the finish script, at RPUSH ' .. reply .. ')')
  elseif length == 1 then
    redis.call('EXPIRE', reply, ttl)
  else
    redis.call('LTRIM', reply, 0, -2)
  end
  return true
end
-- A staged reply: moved unless a key is there (a list: a reply already stands; else what it
-- holds is returned). False when the staged reply is gone (refused for memory, or
-- evicted): the entry then stays pending and is answered again.
local function move(staged, reply)
  local moved = redis.pcall('RENAMENX', staged, reply)
  if type(moved) == 'table' and moved.err then
    if string.find(moved.err, 'no such key', 1, true) then return false end
    return redis.error_reply(moved.err .. ' (the finish script, at RENAMENX ' .. staged
      .. ' ' .. reply .. ')')
  elseif moved == 0 then
    redis.call('DEL', staged)
    -- LTRIM 0 -1 keeps a list as it is and refuses any other type: a write-only type test
    local kept = redis.pcall('LTRIM', reply, 0, -1)
    if type(kept) == 'table' and kept.err then
      if string.sub(kept.err, 1, 9) == 'WRONGTYPE' then return held(reply) end
      return redis.error_reply(kept.err .. ' (the finish script, at LTRIM ' .. reply .. ')')
    end
  end
  return true
end
-- The entry's rid and body (each once, a value over the bound replaced by a note), its reason
-- naming a few of its other fields, and its lane (the stream); returns Redis's error when the
-- XADD is refused.
local function dead_letter(id, reason)
  local entry = redis.call('XRANGE', stream, id, id)
  local copy, seen, others, more = {}, {}, {}, 0
  local fields = entry[1] and entry[1][2] or {}
  for j = 1, #fields - 1, 2 do
    local name, value = fields[j], fields[j + 1]
    if (name == 'rid' or name == 'body') and not seen[name] then
      seen[name] = true
      if #value > bound then
        value = '<dropped: ' .. #value .. ' bytes, over max_request_bytes>'
      end
      copy[#copy + 1] = name
      copy[#copy + 1] = value
    elseif #others < 8 then
      others[#others + 1] = string.sub(name, 1, 64)
    else
      more = more + 1
    end
  end
  if #others > 0 then
    reason = reason .. '; also had fields ' .. table.concat(others, ', ')
    if more > 0 then reason = reason .. ' and ' .. more .. ' more' end
  end
  copy[#copy + 1] = 'reason'
  copy[#copy + 1] = reason
  copy[#copy + 1] = 'lane'
  copy[#copy + 1] = stream
  local added = redis.pcall('XADD', dead, '*', unpack(copy))
  if type(added) == 'table' and added.err then return added.err end
  return nil
end
local page, failed = pending(lo, hi, span)
if failed then return failed end
local mine = {}
for _, p in ipairs(page) do mine[p[1]] = true end
local acked = {}
-- per entry, in order: '1' finished here, '0' not this consumer's to finish, '2' this
-- consumer's, but its staged reply is gone: send it again inside the script
local flags = {}
local refused = {}  -- {index, what, detail, held} per refusal: rare
for i = 0, n - 1 do
  local base = 8 + i * 6
  local id, ki, reason, how = ARGV[base], tonumber(ARGV[base + 1]), ARGV[base + 2], ARGV[base + 3]
  local ours = mine[id]
  if ours == nil and #page >= span then  -- a full page may have cut it off: ask for it alone
    local one
    one, failed = pending(id, id, 1)
    if failed then return failed end
    ours = one[1] ~= nil
  end
  mine[id] = false  -- an id twice in one batch is finished once
  local flag = ours and '1' or '0'
  local done, reply = true, nil
  if how == 's' and not ours then
    redis.call('DEL', KEYS[ki])
  elseif how == 's' then
    reply = KEYS[ki + 1]
    done = move(KEYS[ki], reply)
    if done == false then ours, flag = false, '2' end
  elseif how == 'i' and ours then
    reply = KEYS[ki]
    done = push(reply, ARGV[base + 5], ARGV[base + 4])
  end
  if type(done) == 'table' then return done end
  if type(done) == 'string' then  -- the reply key holds another type: dead-letter the entry
    local why = 'reply key ' .. reply .. ' holds ' .. done .. ', not a list: no reply could '
      .. 'be written (an operator or another program wrote that key)'
    refused[#refused + 1] = {i, 'reply', why, done}
    reason = reason == '' and why or reason .. '; ' .. why
  end
  if ours then
    if reason ~= '' then
      local err = dead_letter(id, reason)
      if err then refused[#refused + 1] = {i, 'dead', err, held(dead)} end
    end
    acked[#acked + 1] = id
  end
  flags[i + 1] = flag
end
for first = 1, #acked, 1000 do
  local last = math.min(first + 999, #acked)
  redis.call('XACK', stream, group, unpack(acked, first, last))
  redis.call('XDEL', stream, unpack(acked, first, last))
end
if #refused == 0 then return table.concat(flags) end
return {table.concat(flags), unpack(refused)}
"""

#: The script's flag per entry: finished here, not ours, ours but its staged reply was gone.
FLAGS: dict[int, bool | None] = {ord("1"): True, ord("0"): False, ord("2"): None}


@dataclass(frozen=True, slots=True)
class Refused:
    """One write the script's Redis refused for good: the entry's reply (``what`` "reply": the
    entry was dead-lettered instead) or its dead letter (``what`` "dead": lost). ``index`` is
    the entry's place in the run; ``held``, what the refusing key holds ("a string"; "another
    type" where the worker may not run ``TYPE`` on it)."""

    index: int
    what: str
    detail: str
    held: str


def read_answer(answer: Any) -> tuple[bytes, list[Refused]]:
    """The script's flags, and what Redis refused (usually nothing)."""
    if isinstance(answer, list):
        return _bytes(answer[0]), [
            Refused(int(i), _text(what), _text(detail), _text(kind))
            for i, what, detail, kind in answer[1:]
        ]
    return _bytes(answer), []


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
