# ruff: noqa: E501  (paragraphs of the text stay one line each: the text is hashed as is)
"""The fixed text of the perplexity guard (services/inference/engine/quality.py): plain English, about
400 SmolLM2 tokens. A Python module rather than a data file, so every install (wheel, image)
carries it. Changing it invalidates every stored check (they record its sha256)."""

TEXT = """\
The old lighthouse stood at the end of a narrow spit of land, where the river met the sea. For more than a century it had warned ships away from the sandbanks that shifted with every storm. The keeper lived in a small stone house at its foot, and each evening he climbed the spiral stairs to light the lamp, wind the clockwork that turned the lens, and write a line in the logbook about the weather.

Most of the entries were short. "Wind from the west, light rain, two fishing boats came in before dark." "Calm sea, clear sky, the lamp burned all night without trouble." Now and then a longer entry told of a gale, a ship that ran aground, or a rescue made by the lifeboat crew from the village across the bay.

When the lighthouse was finally automated, the keeper moved to a cottage in the village. He kept the habit of walking to the harbour every morning to look at the water and talk with the fishermen. Children often asked him whether he missed the tower. He would smile and say that he still saw the light every night from his kitchen window, and that it was good to know it no longer needed him to keep turning.

Scientists who study the coast say that the sandbanks are moving slowly to the north. They measure the depth of the water with sound, compare their maps from year to year, and publish the results so that pilots can plan safe routes. Their work is less romantic than the keeper's, but it serves the same purpose: to help people cross dangerous water and come home safely.

A good map, like a good light, is useful only if it is kept up to date. The sea changes, the river carries new sand, and the safe channel of ten years ago may be the shallowest place today. That is why the charts are revised, the buoys are moved, and the logbooks, old and new, are read with care.
"""
