"""kvguard.operator: the Kubernetes operator (planner, policy, canary, rollout, render, kube, handlers).

Pure modules (api, planner, policy, rollout, render, canary) import neither kopf, kubernetes nor
torch; only kube, backends and handlers talk to the outside world.
"""
