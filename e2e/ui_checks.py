"""What a user sees in the orchestrators' own UIs, checked in a real browser and saved as
the screenshots the docs show (docs/img/).

- Airflow: the "Add Connection" form for conn type ``pandastack`` (relabelled fields,
  placeholders, hidden fields, the extra fields from ``conn-fields``);
- Prefect: the saved credentials block's page (the key shown as stars) and a flow run's
  report artifact (its markdown, with the report's table, rendered).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from .browser import page_text, screenshot, wait_until


def airflow_connection_form(driver: Any, api: str) -> list[Path]:
    driver.get(f"{api}/connections")
    wait_until(
        "the Add Connection button",
        lambda: driver.find_element(By.XPATH, "//button[normalize-space()='Add Connection']"),
    ).click()
    wait_until("the connection id field", lambda: driver.find_element(By.NAME, "connection_id")).send_keys(
        "pandastack_default"
    )
    conn_type = driver.find_element(By.CSS_SELECTOR, "[role=combobox]")
    conn_type.click()
    conn_type.send_keys("pandastack")
    wait_until("the PandaStack option", lambda: "PandaStack" in page_text(driver))
    conn_type.send_keys(Keys.ENTER)

    host = wait_until("the host field", lambda: driver.find_element(By.NAME, "host"))
    password = driver.find_element(By.NAME, "password")
    assert host.get_attribute("placeholder") == "https://api.pandastack.ai"
    assert password.get_attribute("placeholder") == "pds_..."
    assert password.get_attribute("type") == "password"
    text = page_text(driver)
    for label in ("API URL", "API key"):
        assert label in text, text
    for hidden in ("login", "port", "schema"):
        assert not driver.find_elements(By.NAME, hidden), f"{hidden} should be hidden"
    form = screenshot(driver, "airflow-connection-form.png")

    driver.find_element(By.XPATH, "//button[normalize-space()='Extra Fields']").click()
    wait_until(
        "the extra fields",
        lambda: driver.find_element(By.NAME, "element_max_create_retry_seconds").is_displayed(),
    )
    text = page_text(driver)
    for label in ("Create retry budget (seconds)", "Request timeout (seconds)"):
        assert label in text, text
    return [form, screenshot(driver, "airflow-connection-extra-fields.png")]


def prefect_credentials_block(driver: Any, ui: str, block_id: str, api_key: str) -> Path:
    driver.get(f"{ui}/blocks/block/{block_id}")
    text = wait_until("the block page", lambda: (t := page_text(driver)) and "API key" in t and t)
    assert "PandaStack Credentials" in text, text
    assert "********" in text, text
    assert api_key not in text and api_key not in driver.page_source
    return screenshot(driver, "prefect-credentials-block.png")


def prefect_report_artifact(driver: Any, ui: str, artifact_id: str) -> Path:
    driver.get(f"{ui}/artifacts/artifact/{artifact_id}")
    wait_until("the rendered report", lambda: driver.find_elements(By.CSS_SELECTOR, "table td"))
    text = page_text(driver)
    assert "Orders report for" in text, text
    cells = [td.text for td in driver.find_elements(By.CSS_SELECTOR, "table td")]
    assert "north" in cells, cells
    return screenshot(driver, "prefect-report-artifact.png")
