"""The engine's front ends: ``LLM`` (offline, ``llm``), ``AsyncEngine`` (step loop in a thread,
``async_engine``) and ``ProcessEngine`` (step loop in a child process, ``process_engine``), the last two on the
``EngineFront`` base of ``engine_front``. Each builds one ``EngineRequest`` per request and hands it to the core.
"""
