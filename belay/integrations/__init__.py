"""Agent frameworks on belay: each module is an optional extra.

- :mod:`belay.integrations.pydantic_ai` — a PydanticAI durability capability and
  ``run_agent_job`` (extra ``pydantic-ai``).
- :mod:`belay.integrations.langgraph` — LangGraph graphs as jobs on LangGraph's own
  ``PostgresSaver``, and ``BelayMiddleware`` for LangChain agents (extra ``langgraph``).
"""
