//! The blocks of `block_for` limits in Redis: a field `<bucket>!b` of the bucket's page, beside
//! the bucket (lua/bucket.lua `block_until`), whose ts is the microsecond the block ends. Listed
//! by scanning the pages, lifted by deleting the field and the bucket (so it is full again):
//! both for the admin API only, never on a request's path.

use fred::prelude::{Key, Value};

use fred::prelude::LuaInterface;

use super::connect::Conn;
use super::{RedisStore, int, store_error};
use crate::nodes::Script;
use crate::page::page_of;
use crate::{Blocks, StoreError};

/// Every page's block fields whose block has not ended: `{now, name, end, name, end, …}`. One
/// script, so the list is one instant's; it runs as long as the pages take to scan, which only
/// an operator's request asks for.
const LIST: &str = r#"
local now = tonumber(ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local out = { now }
local cursor = '0'
repeat
  local r = redis.call('SCAN', cursor, 'MATCH', 'rl:page:*', 'COUNT', 1000)
  cursor = r[1]
  for _, page in ipairs(r[2]) do
    local at = '0'
    repeat
      local h = redis.call('HSCAN', page, at, 'MATCH', '*!b', 'COUNT', 1000)
      at = h[1]
      local kv = h[2]
      for i = 1, #kv, 2 do
        local v = kv[i + 1]
        if #v == 25 then
          local ends = struct.unpack('<I7', v, 8)
          if ends > now then
            out[#out + 1] = string.sub(kv[i], 1, -3)
            out[#out + 1] = ends
          end
        end
      end
    until at == '0'
  end
until cursor == '0'
return out
"#;

/// Deletes one bucket's block field: 1 when its block had not ended. A block lifted in force
/// takes the bucket with it (its field, and its key from before pages), in the same step: a
/// missing bucket reads as full, where the one the refusal left empty would block again.
const LIFT: &str = r#"
local now = tonumber(ARGV[2])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local v = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
if v and #v == 25 and struct.unpack('<I7', v, 8) > now then
  redis.call('HDEL', KEYS[1], KEYS[2])
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
"#;

impl RedisStore {
    /// The blocks in force. A Redis Cluster's pages are spread over its primaries: the list is
    /// run on each, and one that doesn't answer fails the whole list rather than half of it.
    pub async fn list_blocks(&self) -> Result<Blocks, StoreError> {
        let args = || vec![Value::Integer(self.shared.clock_arg())];
        let answers: Vec<Value> = match &self.shared.client {
            Conn::One(_) => vec![
                self.shared
                    .client
                    .run(Script::Text(LIST), Vec::new(), args())
                    .await
                    .map_err(|e| store_error(&e))?,
            ],
            Conn::Cluster(nodes) => {
                let primaries = nodes.primaries();
                if primaries.is_empty() {
                    return Err(StoreError::Unavailable("no cluster primary is connected".into()));
                }
                let mut all = Vec::with_capacity(primaries.len());
                for (server, pool) in primaries {
                    let v: Value = pool.eval(LIST, Vec::<Key>::new(), args()).await.map_err(|e| {
                        StoreError::Unavailable(format!(
                            "primary {}:{}: {}",
                            server.host,
                            server.port,
                            e.details()
                        ))
                    })?;
                    all.push(v);
                }
                all
            }
        };
        let mut blocks = Blocks {
            now_us: 0,
            list: Vec::new(),
        };
        for v in answers {
            let (now_us, list) = read_list(v)?;
            // The latest primary's clock: a block it still shows has not ended by then.
            blocks.now_us = blocks.now_us.max(now_us);
            blocks.list.extend(list);
        }
        blocks.list.retain(|(_, end)| *end > blocks.now_us);
        blocks.list.sort();
        Ok(blocks)
    }

    /// Lifts `bucket`'s block and refills the bucket: whether it had a block in force.
    pub async fn lift_block(&self, bucket: &str) -> Result<bool, StoreError> {
        let v = self
            .shared
            .client
            .run(
                Script::Text(LIFT),
                vec![Key::from(page_of(bucket)), Key::from(bucket)],
                vec![
                    Value::from(format!("{bucket}!b")),
                    Value::Integer(self.shared.clock_arg()),
                ],
            )
            .await
            .map_err(|e| store_error(&e))?;
        Ok(int(&v) == Some(1))
    }
}

/// One node's answer to [`LIST`]: its now and its blocks.
fn read_list(v: Value) -> Result<(u64, Vec<(String, u64)>), StoreError> {
    let bad = |what: &str| StoreError::Protocol(format!("the block list answered {what}"));
    let Value::Array(items) = v else {
        return Err(bad("something else than an array"));
    };
    let now_us = items.first().and_then(int).ok_or_else(|| bad("no now"))? as u64;
    let mut list = Vec::with_capacity(items.len() / 2);
    for pair in items[1..].chunks(2) {
        let [name, end] = pair else {
            return Err(bad("a name without an end"));
        };
        let name = name
            .as_str()
            .ok_or_else(|| bad("a name that is not text"))?
            .to_string();
        let end = int(end).ok_or_else(|| bad("an end that is not a number"))? as u64;
        list.push((name, end));
    }
    Ok((now_us, list))
}
