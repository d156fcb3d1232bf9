"""The engine: admission, decisions, pricing, records, settlement and the admin API.

Plain async Python with no ASGI in it; :class:`~spendguard.engine.guard.SpendGuard` is the
entry point. Submodules are imported where they are used, so that importing one (say, the
decision values) does not pull in all of them.
"""
