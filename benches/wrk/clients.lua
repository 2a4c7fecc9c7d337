-- wrk script of benches/keys.sh: GET with an X-Client header taken from N values.
--   wrk ... -s benches/wrk/clients.lua URL -- fill N KEY DONE  each value c0..c(N-1) once, in
--                                                     order, then write the file DONE
--   wrk ... -s benches/wrk/clients.lua URL -- random N KEY     values at random from the N
-- One wrk thread (-t1) for fill: the counter is the thread's own. wrk runs for its duration
-- whatever a thread does, so the caller ends a fill with SIGINT once DONE is there.
local mode, n, key, done
local sent, answered = 0, 0

function init(args)
  mode, n, key, done = args[1], tonumber(args[2]), args[3], args[4]
  if (mode ~= "fill" and mode ~= "random") or not n or n < 1 or not key then
    error("clients.lua takes: fill|random N KEY")
  end
  math.randomseed(os.time())
  if mode == "fill" then
    if not done then error("clients.lua fill takes: N KEY DONE") end
    response = function(status)
      answered = answered + 1
      if status ~= 200 then
        io.stderr:write("clients.lua: answer " .. status .. "\n")
        os.exit(1)
      end
      if answered == n then
        local f = assert(io.open(done, "w"))
        f:write(answered, "\n")
        f:close()
      end
    end
  end
end

function request()
  local i
  if mode == "fill" then
    i = sent % n
    sent = sent + 1
  else
    i = math.random(0, n - 1)
  end
  return wrk.format("GET", nil, { ["X-API-Key"] = key, ["X-Client"] = "c" .. i })
end
