-- Argo CD health check for omnipipe.io/OmniPipeline. It reads the operator's status as
-- Flux's kstatus does, plus Suspended for a pipeline scaled to zero:
--
--   no status yet, or observedGeneration < generation  Progressing
--   Stalled=True                                       Degraded ("<reason>: <message>")
--   Reconciling=True                                   Progressing (its message)
--   Ready=True, every stage desiredReplicas 0          Suspended
--   Ready=True                                         Healthy (Ready's message)
--   Ready=False, Unknown or missing                    Progressing (Ready's message)
--
-- Install it in Argo CD's argocd-cm ConfigMap, with this file as the key's value:
--
--   apiVersion: v1
--   kind: ConfigMap
--   metadata:
--     name: argocd-cm
--     namespace: argocd
--   data:
--     resource.customizations.health.omnipipe.io_OmniPipeline: |
--       hs = {}
--       ...  (this file, indented)
--       return hs
--
-- With the argo-cd Helm chart the same key goes under `configs.cm`. Argo CD runs it with
-- only the base, table, package and a safe os library open (no `string`), and with
-- a one-second limit. tests/integration/test_health_checks.py runs it in Argo CD's own Lua
-- runtime (hack/build-gitops-tools.sh builds it).

hs = {}

local function find_condition(conditions, wanted)
  for _, c in ipairs(conditions or {}) do
    if c.type == wanted then
      return c
    end
  end
  return nil
end

local function is_true(c)
  return c ~= nil and c.status == "True"
end

-- The condition's message, or its reason where the message is empty.
local function text(c, fallback)
  if c == nil then
    return fallback
  end
  if c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return c.reason or fallback
end

local function all_scaled_to_zero(stages)
  if stages == nil or #stages == 0 then
    return false
  end
  for _, s in ipairs(stages) do
    if s.desiredReplicas ~= 0 then
      return false
    end
  end
  return true
end

local generation = obj.metadata.generation or 0
local status = obj.status
if status == nil or status.observedGeneration == nil or status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local stalled = find_condition(status.conditions, "Stalled")
local reconciling = find_condition(status.conditions, "Reconciling")
local ready = find_condition(status.conditions, "Ready")

if is_true(stalled) then
  hs.status = "Degraded"
  hs.message = tostring(stalled.reason)
  if stalled.message ~= nil and stalled.message ~= "" then
    hs.message = hs.message .. ": " .. stalled.message
  end
elseif is_true(reconciling) then
  hs.status = "Progressing"
  hs.message = text(reconciling, "reconciling")
elseif is_true(ready) and all_scaled_to_zero(status.stages) then
  hs.status = "Suspended"
  hs.message = "scaled to zero; wakes on demand"
elseif is_true(ready) then
  hs.status = "Healthy"
  hs.message = text(ready, "ready")
else
  hs.status = "Progressing"
  hs.message = text(ready, "waiting for the Ready condition")
end
return hs
