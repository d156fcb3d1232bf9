"""SQLAlchemy Core tables of the ledger. Money is BIGINT micro-USD, times are epoch microseconds.

Teams and API keys are stored twice: the encoded id (``team``/``api_key``, bounded and safe,
used in every key and index) and the raw id the host app gave (``team_id``/``api_key_id``,
for display only). A team-scoped row has ``api_key = ''``; encoded ids are never empty.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from ..limits import Period, Window

metadata = sa.MetaData()

policies = sa.Table(
    "spendguard_policies",
    metadata,
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("api_key", sa.String(100), primary_key=True),
    sa.Column("period", sa.String(8), primary_key=True),
    sa.Column("team_id", sa.Text, nullable=False),
    sa.Column("api_key_id", sa.Text, nullable=True),
    sa.Column("limit_micros", sa.BigInteger, nullable=False),
    sa.Column("active", sa.Boolean, nullable=False),
    # Added after the first release: databases created before get it at start (see
    # LedgerDatabase._add_missing_columns).
    sa.Column("hard", sa.Boolean, nullable=False, server_default=sa.false()),
    # The limit's own alert thresholds ("50,80"; "": none); NULL: the gateway's default.
    sa.Column("alert_at", sa.Text, nullable=True),
    sa.Column("created_us", sa.BigInteger, nullable=False),
    sa.Column("updated_us", sa.BigInteger, nullable=False),
    # A hard limit that fits a refused request's output cap instead (added like ``hard``).
    sa.Column("fit", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.CheckConstraint("limit_micros >= 0", name="spendguard_policy_limit_nonneg"),
)

# Models a key (api_key '') or a whole team (api_key '' and team-wide) may call: exact names or
# globs. No active row for a subject: every model is allowed.
model_access = sa.Table(
    "spendguard_model_access",
    metadata,
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("api_key", sa.String(100), primary_key=True),  # '' = the whole team
    sa.Column("pattern", sa.String(256), primary_key=True),
    sa.Column("team_id", sa.Text, nullable=False),
    sa.Column("api_key_id", sa.Text, nullable=True),
    sa.Column("active", sa.Boolean, nullable=False),
    sa.Column("updated_us", sa.BigInteger, nullable=False),
)

# Request rates of a key (api_key set) or a whole team (api_key ''): requests and tokens per
# minute, requests in flight; NULL: not limited. An inactive row: no rates.
rates = sa.Table(
    "spendguard_rates",
    metadata,
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("api_key", sa.String(100), primary_key=True),  # '' = the whole team
    sa.Column("team_id", sa.Text, nullable=False),
    sa.Column("api_key_id", sa.Text, nullable=True),
    sa.Column("rpm", sa.BigInteger, nullable=True),
    sa.Column("tpm", sa.BigInteger, nullable=True),
    sa.Column("max_parallel", sa.BigInteger, nullable=True),
    sa.Column("active", sa.Boolean, nullable=False),
    sa.Column("updated_us", sa.BigInteger, nullable=False),
)

records = sa.Table(
    "spendguard_records",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("inference_id", sa.String(64), nullable=False),
    sa.Column("team", sa.String(100), nullable=False),
    sa.Column("api_key", sa.String(100), nullable=False),
    sa.Column("team_id", sa.Text, nullable=False),
    sa.Column("api_key_id", sa.Text, nullable=True),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("route", sa.Text, nullable=False),
    sa.Column("t0_us", sa.BigInteger, nullable=False),
    sa.Column("status_code", sa.Integer, nullable=False),
    sa.Column("input_tokens", sa.BigInteger, nullable=False),
    sa.Column("output_tokens", sa.BigInteger, nullable=False),
    sa.Column("cached_input_tokens", sa.BigInteger, nullable=False),
    sa.Column("cache_write_tokens", sa.BigInteger, nullable=False),
    sa.Column("usage_estimated", sa.Boolean, nullable=False),
    sa.Column("estimate_micros", sa.BigInteger, nullable=False),
    sa.Column("postflight", sa.String(16), nullable=False),
    sa.Column("settled", sa.Boolean, nullable=False, default=False),
    sa.Column("created_us", sa.BigInteger, nullable=False),
    # The unit prices the record was estimated at (``Price.encode``; '' = charged nothing):
    # settlement charges them, not the settling process's table. NULL in rows written before
    # records carried it, which are priced by the table. Added after the first release (see
    # LedgerDatabase._add_missing_columns).
    sa.Column("price", sa.Text, nullable=True),
    # The end user (encoded, for filters; raw, for display) and the tags (encoded, each
    # between commas: ",a,b,", so one is found by its ",a,"; raw, as a JSON list). NULL: none,
    # or a record written before records carried them (added like ``price``).
    sa.Column("end_user", sa.String(100), nullable=True),
    sa.Column("end_user_id", sa.Text, nullable=True),
    sa.Column("tags", sa.Text, nullable=True),
    sa.Column("tag_ids", sa.Text, nullable=True),
    sa.Column("customer", sa.String(100), nullable=True),  # encoded; raw beside it
    sa.Column("customer_id", sa.Text, nullable=True),
    # Settlement's queue: the unsettled records, in claim order. Partial, so marking a record
    # settled adds no entry here (a full index on the flag took one per record settled, a
    # fifth of a claim) and the index stays the size of the backlog, not of the history.
    sa.Index(
        "spendguard_records_to_settle",
        "created_us",
        "id",
        postgresql_where=sa.text("NOT settled"),
        sqlite_where=sa.text("settled = 0"),
    ),
    # A budget bucket Redis never had (a never-seen end user's, tag's or customer's first
    # request) or lost is rebuilt from the records of its subject within its longest window
    # (BudgetQueries.used_slices): one indexed range each, never a walk of the whole history.
    # The reports' time ranges use the last one too. Partial where most records have none.
    sa.Index("spendguard_records_key_t0", "team", "api_key", "t0_us"),
    sa.Index(
        "spendguard_records_end_user_t0",
        "team",
        "end_user",
        "t0_us",
        postgresql_where=sa.text("end_user IS NOT NULL"),
        sqlite_where=sa.text("end_user IS NOT NULL"),
    ),
    sa.Index(
        "spendguard_records_customer_t0",
        "customer",
        "t0_us",
        postgresql_where=sa.text("customer IS NOT NULL"),
        sqlite_where=sa.text("customer IS NOT NULL"),
    ),
    sa.Index("spendguard_records_t0", "t0_us"),  # a model's, a tag's, the fleet's
)

charges = sa.Table(
    "spendguard_charges",
    metadata,
    # The primary key is the record: at most one charge per record, whoever settles it.
    sa.Column("record_id", sa.String(64), primary_key=True),
    sa.Column("team", sa.String(100), nullable=False),
    sa.Column("api_key", sa.String(100), nullable=False),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("day_id", sa.String(8), nullable=False),
    sa.Column("month_id", sa.String(6), nullable=False),
    sa.Column("amount_micros", sa.BigInteger, nullable=False),
    sa.Column("settled_us", sa.BigInteger, nullable=False),
    # One index serves both windows: a day lies in one month, so a day's charges are found
    # under (team, month, day). Every charge settled writes each index once; two indexes (one
    # per window) cost a fifth more per charge written.
    sa.Index("spendguard_charges_team_bucket", "team", "month_id", "day_id", "api_key"),
)


# Indexes of earlier releases that a later one replaced: dropped at start, after their
# replacements are built (see LedgerDatabase.init_schema).
RETIRED_INDEXES = (
    "spendguard_records_unsettled",  # became spendguard_records_to_settle (partial)
    "spendguard_charges_team_month",  # both became spendguard_charges_team_bucket
    "spendguard_charges_team_day",
)


def charges_in(window: Window, t: datetime) -> list[sa.ColumnElement[bool]]:
    """The filter for the charges of ``window``'s bucket containing ``t``: a charge carries the
    bucket of each calendar window its record's ``t0`` fell in, so a window's spend is one
    indexed range (a day's filter names its month too, the index's leading column)."""
    month = charges.c.month_id == Period.MONTH.bucket(t)
    if window is Period.DAY:
        return [month, charges.c.day_id == Period.DAY.bucket(t)]
    return [month]


aggregates = sa.Table(
    "spendguard_aggregates",
    metadata,
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("api_key", sa.String(100), primary_key=True),
    sa.Column("period", sa.String(8), primary_key=True),
    sa.Column("period_id", sa.String(8), primary_key=True),
    sa.Column("settled_micros", sa.BigInteger, nullable=False),
    sa.Column("updated_us", sa.BigInteger, nullable=False),
)

# Prepaid credit per team (optional). Balance = topped_up - charged. Both only grow, so a
# cache can take the larger of two reads and never move backwards. A team without a row is
# not balance-limited; settlement debits only charges settled after the account existed.
balances = sa.Table(
    "spendguard_balances",
    metadata,
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("team_id", sa.Text, nullable=False),
    sa.Column("topped_up_micros", sa.BigInteger, nullable=False),
    sa.Column("charged_micros", sa.BigInteger, nullable=False),
    sa.Column("created_us", sa.BigInteger, nullable=False),
    sa.Column("updated_us", sa.BigInteger, nullable=False),
    # A hard balance admits a request only if its worst case fits what is left. Added after
    # the first release (see LedgerDatabase._add_missing_columns).
    sa.Column("hard", sa.Boolean, nullable=False, server_default=sa.false()),
)

topups = sa.Table(
    "spendguard_topups",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("team", sa.String(100), nullable=False, index=True),
    sa.Column("amount_micros", sa.BigInteger, nullable=False),
    sa.Column("at_us", sa.BigInteger, nullable=False),
    sa.CheckConstraint("amount_micros > 0", name="spendguard_topup_positive"),
    # Every process's cache sync asks which teams were topped up since its last pass.
    sa.Index("spendguard_topups_at", "at_us"),
)

# The settlement journal: one row per settlement transaction, written as its last statement,
# naming the records it settled (JSON: team -> [[record id, api key, t0_us, unknown], ...]).
# Every process's cache sync follows it by ``seq`` instead of re-reading every pending estimate
# in its cache (design.md, "Settlement"). Rows are pruned after a while; a process that fell
# further behind re-reads its cache's markers instead.
settlements = sa.Table(
    "spendguard_settlements",
    metadata,
    # SQLite assigns it in commit order (one writer at a time); PostgreSQL's sequence may
    # commit out of order, which the cache sync allows for (engine/cachesync.py).
    sa.Column(
        "seq",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("settled_us", sa.BigInteger, nullable=False),
    sa.Column("records", sa.Text, nullable=False),
    sa.Index("spendguard_settlements_settled", "settled_us"),
    # Never reuse a number, not even after pruning emptied the table: a reader past it would
    # skip the rows that took it again.
    sqlite_autoincrement=True,
)

# A key's own token budget (a per-key override of the budgets section's per_api_key default):
# ``max_tokens`` over a rolling ``budget_window`` (a period such as 24h). One row per key.
budget_overrides = sa.Table(
    "spendguard_budget_overrides",
    metadata,
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("api_key", sa.String(100), primary_key=True),
    sa.Column("team_id", sa.Text, nullable=False),
    sa.Column("api_key_id", sa.Text, nullable=False),
    sa.Column("max_tokens", sa.BigInteger, nullable=False),
    sa.Column("budget_window", sa.String(32), nullable=False),
    sa.Column("updated_us", sa.BigInteger, nullable=False),
    sa.CheckConstraint("max_tokens > 0", name="spendguard_budget_override_positive"),
)

# A customer's prepaid account (the organisation above teams): what was topped up, in
# micro-USD. What its teams used is counted in the customer's budget bucket, rebuilt from the
# records that carry the customer (docs: rolling-budgets.md, "A customer's prepaid balance").
customer_balances = sa.Table(
    "spendguard_customer_balances",
    metadata,
    sa.Column("customer", sa.String(100), primary_key=True),  # encoded
    sa.Column("customer_id", sa.Text, nullable=False),  # as the app named it
    sa.Column("topped_up_micros", sa.BigInteger, nullable=False),
    sa.Column("updated_us", sa.BigInteger, nullable=False),
    sa.CheckConstraint("topped_up_micros > 0", name="spendguard_customer_balance_positive"),
)

# Threshold alerts (the outbox): a row per alert, whichever gateway fired or moved it first
# (the id is the same every time one threshold of one limit amount fires in one window). A row
# is delivered once ``delivered_us`` is set; until then a gateway claims it (``claimed_us``:
# until when) before sending, and a failed send sets when to try again (``next_us``).
alerts = sa.Table(
    "spendguard_alerts",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("team", sa.String(100), nullable=False),
    sa.Column("api_key", sa.String(100), nullable=False),  # '' = a team's limit
    # "day", "month", "balance", or a budget window's id (up to 64 characters)
    sa.Column("period", sa.String(64), nullable=False),
    sa.Column("bucket", sa.String(24), nullable=False),  # a budget's: its window epoch
    sa.Column("scope", sa.String(8), nullable=False, server_default="spend"),  # or "budget"
    sa.Column("unit", sa.String(8), nullable=False, server_default="usd"),  # or "tokens"
    sa.Column("model", sa.Text, nullable=True),  # a model's budget
    sa.Column("percent", sa.Integer, nullable=False),
    sa.Column("limit_micros", sa.BigInteger, nullable=False),
    sa.Column("used_micros", sa.BigInteger, nullable=False),
    sa.Column("fired_us", sa.BigInteger, nullable=False),
    sa.Column("runs_out_us", sa.BigInteger, nullable=True),  # a projected alert's forecast
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_us", sa.BigInteger, nullable=False),
    sa.Column("claimed_us", sa.BigInteger, nullable=False),
    sa.Column("delivered_us", sa.BigInteger, nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Index("spendguard_alerts_due", "delivered_us", "next_us"),
    sa.Index("spendguard_alerts_fired", "fired_us"),
)

# Recent denials, for the reports a person reads (kept a week): who, by what, which model.
denials = sa.Table(
    "spendguard_denials",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("team", sa.String(100), nullable=False),
    sa.Column("api_key", sa.String(100), nullable=False),  # '' = no key
    sa.Column("team_id", sa.Text, nullable=False),
    sa.Column("api_key_id", sa.Text, nullable=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("at_us", sa.BigInteger, nullable=False),
    sa.Index("spendguard_denials_team_at", "team", "at_us"),
    sa.Index("spendguard_denials_at", "at_us"),
)
