"""The spend page in a real headless browser (Debian's Chromium, driven through ChromeDriver):
what a person sees after signing in with the admin token on the demo gateway, which has
limits, spend, a forecast and alerts to show. The JSON routes never take the page's cookie."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import clean_env, run_cli, serve_demo

TOKEN = "page-" + "t" * 27
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    if os.environ.get("CI") == "true":
        pytest.fail("chromium and chromedriver are needed (Debian: chromium chromium-driver)")
    pytest.skip("no chromium/chromedriver here", allow_module_level=True)

from selenium import webdriver  # noqa: E402 (only with a browser to drive)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return clean_env(
        SPENDGUARD_DATABASE_URL=f"sqlite:///{tmp_path / 'ledger.db'}",
        SPENDGUARD_ADMIN_TOKEN=TOKEN,
        SPENDGUARD_ALERT_THRESHOLDS="50,80,100",
        SPENDGUARD_SETTLE_INTERVAL="0.5",
    )


@pytest.fixture
def base(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    yield from serve_demo(env, tmp_path / "gw.log")


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1150"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    driver.implicitly_wait(5)  # an element a page load is still bringing
    try:
        yield driver
    finally:
        driver.quit()


def spend(base: str, key: str, n: int) -> None:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            r = c.post(
                f"{base}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            assert r.status_code in (200, 429)


@pytest.mark.timeout(120)
def test_a_person_signs_in_and_sees_limits_top_spenders_and_alerts(
    base: str, env: dict[str, str], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    run_cli(
        env,
        "policy",
        "set",
        "--team",
        "acme",
        "--api-key",
        "alpha",
        "--period",
        "day",
        "--limit-usd",
        "0.0001",
    )
    run_cli(env, "policy", "set", "--team", "acme", "--period", "month", "--limit-usd", "50")
    spend(base, "sk-demo-alpha", 30)  # past the key's day limit: refused once there
    spend(base, "sk-demo-beta", 3)
    page = f"{base}/admin/spendguard/page"

    # The cookie is not a token: the JSON routes still want the header.
    assert httpx.get(f"{base}/admin/spendguard/teams").status_code == 401

    browser.get(page)
    field = browser.find_element(By.ID, "token")
    field.send_keys("not-the-token")
    field.submit()
    assert browser.find_element(By.ID, "wrong").text == "Wrong token."
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "token").submit()
    # The alerts pass runs every second: the page shows them once they are in the outbox.
    deadline = time.monotonic() + 15
    while not {"reached 100%", "api_key:day"} <= set(
        t
        for t in ("reached 100%", "api_key:day")
        if t in browser.find_element(By.TAG_NAME, "body").text
    ):
        assert time.monotonic() < deadline, browser.find_element(By.TAG_NAME, "body").text
        time.sleep(0.5)
        browser.get(page)
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "spendguard: spend" in text
    limits = browser.find_element(By.ID, "limits")
    alpha_day = next(
        r for r in limits.find_elements(By.TAG_NAME, "tr") if r.text.startswith("acme / alpha day")
    )
    meter = alpha_day.find_element(By.CSS_SELECTOR, "[role=meter]")
    assert meter.get_attribute("aria-valuenow") == "100"  # at its limit: a full red bar
    assert "over" in meter.get_attribute("class")
    assert "of $0.000100 (100%+)" in alpha_day.text
    team_month = next(
        r for r in limits.find_elements(By.TAG_NAME, "tr") if r.text.startswith("acme month")
    )
    assert (
        int(team_month.find_element(By.CSS_SELECTOR, "[role=meter]").get_attribute("aria-valuenow"))
        < 1
    )
    assert "runs out" not in team_month.text
    assert len(limits.find_elements(By.TAG_NAME, "tr")) == 1 + 2  # a header, two limits
    top = browser.find_element(By.ID, "top").text
    assert top.index("acme / alpha") < top.index("acme / beta")  # the bigger spender first
    denials = browser.find_element(By.ID, "denials").text
    assert "acme / alpha api_key:day gpt-4o-mini" in denials  # refused at its day limit
    alerts = browser.find_element(By.ID, "alerts").text
    for pct in (50, 80, 100):
        assert f"acme/alpha reached {pct}% of its day limit" in alerts
    shot = Path(os.environ.get("SPENDGUARD_PAGE_SCREENSHOT") or tmp_path / "page.png")
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
